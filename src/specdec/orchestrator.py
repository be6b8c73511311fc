"""The speculative decoding loop: propose -> verify -> accept, with no Triton import.

The loop talks to a Proposer (the draft side) and a Scorer (the target side) that each keep a KV
cache per sequence; every call says how many cached tokens to keep and which tokens to append, so a
rejection rolls back by keeping fewer, and nothing already cached is sent again.

    round:  tokens = prompt + generated                     (length L)
            draft:  keep D, append tokens[D:], propose x_1..x_K      (model cache: L + K - 1)
            target: keep T, append tokens[T:] + x_1..x_K, score K+1 positions   (cache: L + K)
            verdict: n accepted, next token y  ->  tokens += x_1..x_n, y
            valid prefixes: target L + n, draft L + min(n, K - 1)

num_draft_tokens = 0 runs target-only decoding through the same path (the benchmark baseline). With a
DraftLengthPolicy, num_draft_tokens is the maximum and the policy picks each round's k from the
acceptance so far and the measured costs (it may pick 0: a target-only round); the loop times every
call for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import torch

from specdec import tensor_names as tn
from specdec.rejection_sampler import Verdict, greedy_verify, rejection_sample
from specdec.sampling import SamplingParams, logits_to_probs, make_generator
from specdec.speculation_policy import DraftLengthPolicy


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # up to K draft tokens (a proposer may offer fewer, or none)
    probs: torch.Tensor | None  # (len(tokens), V) processed draft distributions; None for greedy
    cached_length: int = 0  # tokens the proposer's cache holds after the call (its valid prefix)


@dataclass(frozen=True)
class Scores:
    greedy_tokens: torch.Tensor  # (K+1,) target argmax at each verified position
    logits: torch.Tensor | None  # (K+1, V) target logits; requested only when sampling
    forward: tuple[int, int, float] | None = None  # the batched forward it ran in: rows, sequences, seconds


class Proposer(Protocol):
    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int,
                      params: SamplingParams, round_seed: int) -> Proposal: ...

    async def release(self, seq_id: int) -> None: ...


class Scorer(Protocol):
    async def score(self, seq_id: int, keep: int, new_ids: list[int], num_positions: int,
                    want_logits: bool) -> Scores: ...

    async def release(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    seq_id: int  # unique per live request: keys both models' KV caches
    prompt_ids: list[int]
    max_tokens: int
    num_draft_tokens: int  # K; 0 = target-only
    sampling: SamplingParams = SamplingParams()
    end_ids: frozenset[int] = frozenset()  # generation stops at (and drops) any of these


@dataclass
class Stats:
    rounds: int = 0
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds accepting draft i+1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens each round produced: the accepted draft tokens plus the target's own token."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class RoundOutput:
    new_tokens: list[int]  # tokens this round adds to the output (after stop handling)
    num_drafted: int
    num_accepted: int
    finish_reason: str | None  # set on the last round


async def generate(req: GenerationRequest, proposer: Proposer, scorer: Scorer, stats: Stats | None = None,
                   policy: DraftLengthPolicy | None = None) -> AsyncIterator[RoundOutput]:
    """Yield one RoundOutput per verify round until a stop condition; caches are released at the end,
    also when the consumer stops early (cancellation) or a call fails."""
    stats = stats if stats is not None else Stats()
    tokens = list(req.prompt_ids)
    draft_valid = 0  # tokens[:draft_valid] are in the draft's cache
    target_valid = 0  # tokens[:target_valid] are in the target's cache
    generated = 0
    generator = None if req.sampling.greedy else make_generator(req.sampling.seed)
    drafted_ever = False
    try:
        while True:
            # Never draft past max_tokens: the bonus token always fills the last slot.
            wanted = policy.next_k() if policy else req.num_draft_tokens
            k = max(0, min(wanted, req.max_tokens - generated - 1))
            proposal = shadow = Proposal([], None)
            if k > 0:
                round_seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator else 0
                started = time.perf_counter()
                proposal = await proposer.propose(req.seq_id, draft_valid, tokens[draft_valid:], k,
                                                  req.sampling, round_seed)
                if policy:
                    policy.observe_draft(k, time.perf_counter() - started)
                draft_valid = proposal.cached_length
                drafted_ever = True
                k = len(proposal.tokens)  # no proposal (an n-gram miss) = a plain target-only round
            elif policy and policy.shadow:  # a free proposer paused: propose, but only to check it
                shadow = await proposer.propose(req.seq_id, draft_valid, tokens[draft_valid:], 1, req.sampling, 0)
                draft_valid = shadow.cached_length
                drafted_ever = True
            new_ids = tokens[target_valid:] + proposal.tokens
            started = time.perf_counter()
            scores = await scorer.score(req.seq_id, target_valid, new_ids, k + 1, want_logits=not req.sampling.greedy)
            if policy and len(new_ids) == k + 1:  # a plain round (no prompt prefill or catch-up)
                policy.observe_verify(k + 1, time.perf_counter() - started)
            if policy and scores.forward:
                policy.observe_forward(*scores.forward)
            verdict = _verify(proposal, scores, req.sampling, generator)
            if policy:
                policy.update(k, verdict.num_accepted)
                if shadow.tokens:  # would its first token have been accepted? (greedy: the target's token)
                    policy.update(1, int(shadow.tokens[0] == verdict.next_token))

            new = proposal.tokens[:verdict.num_accepted] + [verdict.next_token]
            target_valid = len(tokens) + verdict.num_accepted
            draft_valid = min(draft_valid, target_valid)
            tokens += new
            _record(stats, k, verdict.num_accepted)

            new, finish = _apply_stops(new, req.end_ids, req.max_tokens - generated)
            generated += len(new)
            yield RoundOutput(new, k, verdict.num_accepted, finish)
            if finish:
                return
    finally:
        # Runs on normal exit, on an exception and on GeneratorExit (the consumer closed us early).
        if drafted_ever:
            await proposer.release(req.seq_id)
        await scorer.release(req.seq_id)


def _verify(proposal: Proposal, scores: Scores, params: SamplingParams,
            generator: torch.Generator | None) -> Verdict:
    draft = torch.tensor(proposal.tokens, dtype=torch.long)
    if params.greedy:
        return greedy_verify(draft, scores.greedy_tokens.long())
    target_probs = logits_to_probs(scores.logits, params)
    k = len(proposal.tokens)
    draft_probs = proposal.probs if proposal.probs is not None else torch.zeros(0, target_probs.shape[-1])
    uniforms = torch.rand(k, generator=generator)
    return rejection_sample(draft, draft_probs, target_probs, uniforms, generator)


def _record(stats: Stats, k: int, accepted: int) -> None:
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += accepted
    if len(stats.accepted_per_position) < k:
        stats.accepted_per_position.extend([0] * (k - len(stats.accepted_per_position)))
    for i in range(accepted):
        stats.accepted_per_position[i] += 1


def _apply_stops(new: list[int], end_ids: frozenset[int], budget: int) -> tuple[list[int], str | None]:
    """Cut a round's tokens at the first end-of-sequence token (dropped) or at the token budget."""
    for i, token in enumerate(new):
        if token in end_ids and i < budget:
            return new[:i], tn.FINISH_STOP
    if len(new) >= budget:
        return new[:budget], tn.FINISH_LENGTH
    return new, None
