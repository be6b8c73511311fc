"""The speculative decoding loop: propose -> verify -> accept, with no Triton import.

The loop talks to a Proposer (the draft side) and a Scorer (the target side) that each keep a KV
cache per sequence; every call says how many cached tokens to keep and which tokens to append, so a
rejection rolls back by keeping fewer, and nothing already cached is sent again.

    round:  tokens = prompt + generated                     (length L)
            draft:  keep D, append tokens[D:], propose x_1..x_K      (model cache: L + K - 1)
            target: keep T, append tokens[T:] + x_1..x_K, score K+1 positions   (cache: L + K)
            verdict: n accepted, next token y  ->  tokens += x_1..x_n, y
            valid prefixes: target L + n, draft L + min(n, K - 1)

A proposal may be a tree of candidates (`Proposal.parents`): the target scores every node in the same
forward, the verdict is the accepted path (tree_sampler.py), and the next verify moves that path's
keys and values where a chain's would be (`VerifyCall.path`); a trained head is handed the target's
features along that path. Requests whose logits are edited on the host (penalties, bad words, biases, a
grammar) verify the tree's first branch as a chain.

The DraftLengthPolicy owns K: fixed, it drafts K every round (K = 0 is target-only decoding through the
same path, the benchmark baseline); adaptive, K is the maximum and it picks each round's k from the
acceptance so far and the measured costs (it may pick 0: a target-only round), and, for a proposer that
drafts trees, whether this round is a tree or a chain (`policy.width`, passed as the proposer's
`branches`). The loop times every call for it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import torch

from specdec import tensor_names as tn
from specdec.decoding.bad_words import banned_tokens, mask_banned
from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.features import Features, rows_on, with_catch_up
from specdec.decoding.grammar import Grammar, Matcher
from specdec.decoding.thinking import ThinkingBudget
from specdec.decoding.logit_bias import TokenBias, apply_bias
from specdec.decoding.interfaces import DraftAsk, NoCapacity, Proposal, Proposer, Scorer, Scores, VerifyCall
from specdec.decoding.penalties import Penalties, TokenOccurrences, penalize
from specdec.decoding.rejection_sampler import greedy_verify, rejection_sample
from specdec.decoding.sampling import (SamplingParams, greedy, logits_to_probs, make_generator, pad_vocab, token_log_probs,
                                      top_log_probs)
from specdec.decoding.token_mask import mask_disallowed
from specdec.decoding.tree_sampler import (DETERMINISTIC, SAMPLED, TreeVerdict, children, depths, first_branch,
                                           greedy_tree_verify, tree_rejection_sample)


@dataclass(frozen=True)
class GenerationRequest:
    seq_id: int  # unique per live request: keys both models' KV caches
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    end_ids: frozenset[int] = frozenset()  # generation stops at (and drops) any of these
    min_tokens: int = 0  # end tokens before this many generated tokens are generated like any other
    log_probs: bool = False  # report each generated token's log-probability under the target
    top_log_probs: int = 0  # with log_probs: also the n most likely tokens at each generated position
    # with log_probs: also each generated token's rank in the raw distribution (1 + the tokens more likely)
    log_ranks: bool = False
    # the target's log-probability of each prompt token after the first (and with top_log_probs n its
    # positions' n most likely tokens): the first round scores the whole prompt, as a chain
    prompt_log_probs: bool = False
    # TensorRT-LLM's return_generation_logits / return_context_logits: the target's raw logits at each generated
    # position (RoundOutput.logits), and at every prompt position (the first round's RoundOutput.prompt_logits:
    # the prompt scored as for prompt_log_probs, its last row the first verify's)
    generation_logits: bool = False
    context_logits: bool = False
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output never contains (bad_words.py)
    penalties: Penalties = Penalties()  # repetition / presence / frequency (penalties.py)
    # structured output, a thinking budget: the output follows it (grammar.py, thinking.ThinkingBudget)
    grammar: Grammar | ThinkingBudget | None = None
    token_bias: TokenBias = TokenBias()  # logit_bias and allowed_token_ids (logit_bias.py)
    # the LoRA adapter the target runs (its name; "": the base model). Drafts propose as they are: the target's
    # verdict alone decides, so the output is the adapted model's
    lora_name: str = ""
    # its prefix-cache salt (vLLM's cache_salt): the models' caches share its prompt's blocks only with
    # requests of the same salt ("": the shared cache)
    cache_salt: str = ""

    @property
    def edits_logits(self) -> bool:
        """Whether the target's logits are changed before anything reads them (so greedy rounds need them)."""
        return bool(self.bad_words) or self.penalties.active or self.grammar is not None or self.token_bias.active

    @property
    def target_picks(self) -> bool:
        """Whether the target applies the request's one edit itself: a greedy request whose grammar is all
        that edits its logits sends the grammar's bitmask with each verify and gets the best allowed tokens
        back, so no (K+1) x V logits leave the target (on a GPU, none leave the device)."""
        return (self.sampling.greedy and self.grammar is not None and not self.bad_words
                and not self.penalties.active and not self.token_bias.active
                and not self.log_ranks  # a rank needs the raw logits, the target's pick does not send them
                and not self.generation_logits and not self.context_logits)  # nor do these


@dataclass
class Stats:
    rounds: int = 0
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds accepting draft i+1
    cached_tokens: int = 0  # the prompt's tokens the target's prefix cache held (Scores.cached_tokens)
    block_size: int = 0  # the target's KV block's tokens (Scores.block_size); 0: not known yet

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
    log_probs: list[float] | None = None  # with req.log_probs: the target's, one per new token
    depth: int | None = None  # a tree's (its longest branch, num_drafted its nodes); None: a chain
    # with req.top_log_probs n: per new token its position's n most likely tokens and their log-probabilities
    top: tuple[list[list[int]], list[list[float]]] | None = None
    # The first round of a request with prompt_log_probs: each prompt token's after the first, its rank there
    # (1 + the tokens more likely), and with top_log_probs n its position's n most likely tokens and theirs
    prompt_log_probs: list[float] | None = None
    prompt_top: tuple[list[list[int]], list[list[float]]] | None = None
    prompt_ranks: list[int] | None = None
    # with req.generation_logits: (len(new_tokens), V) float32, the target's raw logits at each new token's
    # position; with req.context_logits, the first round's (P, V) at every prompt position
    logits: torch.Tensor | None = None
    prompt_logits: torch.Tensor | None = None
    ranks: list[int] | None = None  # with req.log_ranks: each new token's rank in the target's raw distribution


async def generate(req: GenerationRequest, proposer: Proposer, scorer: Scorer, policy: DraftLengthPolicy,
                   stats: Stats | None = None, cancelled: Callable[[], bool] | None = None,
                   wait_for_room: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[RoundOutput]:
    """Yield one RoundOutput per verify round until a stop condition; caches are released at the end,
    also when the consumer stops early (cancellation) or a call fails. `cancelled` is asked again between
    a round's draft and its verify (a cancellation that arrived while drafting costs no target forward);
    the consumer checks between rounds.

    Each model's first call for the sequence reserves room for the whole generation (prompt + max_tokens
    positions: neither cache ever holds more), so a generation that starts can finish. When the scorer
    has no room yet (NoCapacity), `wait_for_room` is awaited and the call retried while it returns True;
    without it, or once it returns False, NoCapacity propagates. A proposer without room is the
    proposer's business (`FallbackProposer` runs such rounds target-only)."""
    stats = stats if stats is not None else Stats()
    seq = _Sequence.start(req, proposer)
    try:
        while True:
            # this round scores the prompt: a chain
            scoring = (req.prompt_log_probs or req.context_logits) and not seq.target_valid
            proposal, shadow, forced = await _draft(seq, req, proposer, policy, chains_only=not seq.trees or scoring)
            if cancelled is not None and seq.called and shadow is None and cancelled():
                yield RoundOutput([], 0, 0, tn.FINISH_CANCELLED)
                return
            k = len(proposal.tokens)  # none (an n-gram miss, K = 0) = a plain target-only round
            new_ids = seq.tokens[seq.target_valid:] + proposal.tokens
            tree = with_catch_up(len(new_ids) - k, proposal.parents)
            scores = await _verify_call(seq, req, scorer, policy, proposal, new_ids, tree, scoring, wait_for_room)
            if scores.proposal is not None:  # drafted in the verify call, by a head in the target's process
                proposal, new_ids, tree = _drafted_in_verify(seq, req, proposer, policy, proposal, scores, new_ids)
                k = len(proposal.tokens)
            if scores.cached_tokens is not None:
                stats.cached_tokens, stats.block_size = scores.cached_tokens, scores.block_size
            logits = _edited_logits(req, seq.tokens, proposal.tokens, scores.logits, seq.occurrences, seq.matcher)
            verdict = _verify(proposal, scores, logits, req.sampling, seq.generator)
            depth = None if tree is None else max(depths(proposal.parents)) + 1  # a tree's longest branch
            if not forced:  # the policy learns the proposer's acceptance (along a branch), not the grammar's
                _learn(policy, proposal, verdict, depth)
            if shadow is not None and shadow.tokens:  # a paused proposer's guess: the target's token?
                policy.update(1, int(shadow.tokens[0] == verdict.next_token))
            new = _accept(seq, proposal, scores, verdict, new_ids, tree)
            _record(stats, k, len(verdict.path))
            log_probs = _log_probs(scores, new, verdict.path) if req.log_probs else None
            top = _top_log_probs(scores, verdict.path, req.top_log_probs) if req.top_log_probs else None
            ranks = _ranks(scores, new, verdict.path) if req.log_ranks else None
            rows = _path_logits(scores, verdict.path) if req.generation_logits else None
            new, finish = _stops(seq, req, new)
            yield RoundOutput(new, k, len(verdict.path), finish, log_probs and log_probs[:len(new)], depth=depth,
                              top=top and (top[0][:len(new)], top[1][:len(new)]), ranks=ranks and ranks[:len(new)],
                              logits=None if rows is None else rows[:len(new)],
                              **(_prompt_scores(scores, req.top_log_probs, req.context_logits) if scoring else {}))
            if finish:
                return
    finally:
        # Runs on normal exit, on an exception and on GeneratorExit (the consumer closed us early).
        if seq.drafted_ever:
            await proposer.release(req.seq_id)
        await scorer.release(req.seq_id)


@dataclass
class _Sequence:
    """One generation's progress, owned by `generate`: its tokens, how much of them each model's cache
    holds, and what its request needs round after round."""
    tokens: list[int]  # prompt + generated
    reserve: int  # positions each model's first call reserves: prompt + max_tokens
    generator: torch.Generator | None  # sampled requests: the seeded draws of every round
    occurrences: TokenOccurrences | None  # penalised requests: the tokens' counts so far
    matcher: Matcher | None  # structured output: the grammar's state
    features: Features | None  # a proposer that reads the target's features (a trained head)
    trees: bool  # whether proposals may be trees: not where logits are edited on the host
    draft_valid: int = 0  # tokens[:draft_valid] are in the draft's cache
    target_valid: int = 0  # tokens[:target_valid] are in the target's cache
    generated: int = 0
    path: tuple[int, ...] | None = None  # the last verify was a tree: the kept nodes among its new_ids
    called: bool = False  # this round called the proposer
    called_last: bool = False  # the round before did
    drafted_ever: bool = False
    hosted: str = ""  # the proposer is a head in the target's process, named so there (HostedProposer)
    # this round's hosted ask: whether it follows a round that drafted (its draft time is a round's), and
    # whether the draft's cache held the sequence (its length is a proposal's)
    ask_steady: bool = False
    ask_observes: bool = False

    @classmethod
    def start(cls, req: GenerationRequest, proposer: Proposer) -> "_Sequence":
        return cls(list(req.prompt_ids), len(req.prompt_ids) + req.max_tokens,
                   None if req.sampling.greedy else make_generator(req.sampling.seed),
                   TokenOccurrences(req.prompt_ids) if req.penalties.active else None,
                   req.grammar.matcher() if req.grammar is not None else None,
                   Features() if getattr(proposer, "wants_features", False) else None,
                   not req.edits_logits,  # else a tree's first branch is verified as a chain
                   hosted=getattr(proposer, "hosted", ""))


async def _draft(seq: _Sequence, req: GenerationRequest, proposer: Proposer, policy: DraftLengthPolicy,
                 chains_only: bool) -> tuple[Proposal, Proposal | None, bool]:
    """This round's (proposal, shadow proposal, whether the grammar forced it): what the target verifies,
    and a paused free proposer's one-token guess that only the policy reads (None: the proposer was not
    asked for one). Feeds the policy the draft's measured cost and length."""
    # Never draft past max_tokens: the bonus token always fills the last slot.
    room = req.max_tokens - seq.generated - 1
    choose, select = getattr(proposer, "choose", None), getattr(policy, "select", None)
    if choose is not None:  # a proposer of parts (lookup_first.py): the round's part, and its policy
        part = choose(req.seq_id, seq.draft_valid, seq.tokens[seq.draft_valid:])
        if select is not None:
            select(part)
    k = max(0, min(policy.next_k(), room))
    seq.called_last, seq.called = seq.called, False
    none = Proposal([], None, seq.draft_valid)
    # Text the grammar forces is this round's proposal, free (grammar.py); K = 0 stays target-only.
    forced = seq.matcher.forced(min(policy.k_max, room)) if seq.matcher is not None else []
    if forced:
        return Proposal(forced, None, seq.draft_valid), None, True
    reserve = 0 if seq.draft_valid else seq.reserve
    if k > 0:
        round_seed = int(torch.randint(0, 2**62, (1,), generator=seq.generator)) if seq.generator else 0
        started = time.perf_counter()
        proposal = await proposer.propose(req.seq_id, seq.draft_valid, seq.tokens[seq.draft_valid:], k, req.sampling,
                                          round_seed, reserve=reserve, **_features_for(seq.features, seq.draft_valid),
                                          **_width(policy, proposer, not chains_only), **_adapter(req, proposer))
        # what it drafted: a chain may end early (an n-gram's span, a draft's confidence stop). A
        # sequence's first call also prefills its prompt, and one after paused rounds catches up on
        # them: not what a round's draft costs (taken as one, the first priced a trained head's rounds
        # at several target steps, the second its probes at a third of a step, and both stopped its
        # drafting). A steady round's call follows a round that called the draft.
        seconds = time.perf_counter() - started
        steady = bool(seq.draft_valid and seq.called_last and not proposal.caught_up)
        if proposal.ask is None:
            _observe_draft(policy, k, proposal, seconds, steady, bool(seq.draft_valid))
        else:  # observed once the verify call has drafted it
            seq.ask_steady, seq.ask_observes = steady, bool(seq.draft_valid)
            if seq.matcher is not None:  # the grammar's mask needs the proposal before the verify: none
                proposal = dataclasses.replace(proposal, ask=dataclasses.replace(proposal.ask, k=0))
        seq.draft_valid = proposal.cached_length
        seq.drafted_ever = seq.called = True
        if proposal.parents is not None and chains_only:
            proposal = first_branch(proposal)
        if seq.matcher is not None and (req.sampling.greedy or proposal.probs is None):
            proposal = _within_grammar(proposal, seq.matcher)  # exact only for these (grammar.py)
        return proposal, None, False
    if policy.shadow:  # a free proposer paused: propose, but only to check it
        shadow = await proposer.propose(req.seq_id, seq.draft_valid, seq.tokens[seq.draft_valid:], 1, req.sampling, 0,
                                        reserve=reserve, **_features_for(seq.features, seq.draft_valid),
                                        **_width(policy, proposer, False), **_adapter(req, proposer))
        if seq.draft_valid:
            policy.observe_proposal(1, len(shadow.tokens))
        seq.draft_valid = shadow.cached_length
        seq.drafted_ever = seq.called = True
        return none, shadow, False
    return none, None, False


async def _verify_call(seq: _Sequence, req: GenerationRequest, scorer: Scorer, policy: DraftLengthPolicy,
                       proposal: Proposal, new_ids: list[int], tree: tuple[int, ...] | None, scoring: bool,
                       wait_for_room: Callable[[], Awaitable[bool]] | None) -> Scores:
    """The target's scores of the round's K + 1 positions (and, scoring the prompt, of its rows but its
    last); a plain round's forward prices the policy's verifies."""
    k = len(proposal.tokens)
    allowed = seq.matcher.allowed(proposal.tokens, k + 1) if req.target_picks else None
    score_rows = len(new_ids) - k - 1 if scoring else 0  # the prompt's rows but its last
    # A head in the target's process: the call drafts what it asks (k = 0 where another part drafted, or
    # none: the target still keeps the features the head reads next)
    ask = proposal.ask or (DraftAsk(seq.hosted, 0) if seq.hosted else None)
    if ask is not None and (scoring or tree is not None):
        ask = dataclasses.replace(ask, k=0)
    started = time.perf_counter()
    scores = await _score(scorer, req, seq.target_valid, new_ids, k + 1, 0 if seq.target_valid else seq.reserve,
                          wait_for_room, allowed, seq.features is not None, tree, seq.path, score_rows, ask)
    seconds = time.perf_counter() - started
    if scores.proposal is not None:  # the round verified what the head drafted in the call: priced as one
        k = len(scores.proposal.tokens)
        seconds -= scores.proposal.forward.seconds if scores.proposal.forward is not None else 0.0
    if len(new_ids) == len(proposal.tokens) + 1:  # a plain round (no prompt prefill or catch-up)
        policy.observe_verify(k + 1, seconds, scores.forward)
        # Only a verify's forward prices verifies: a prompt's has its rows' logits but its last
        # unread, and where the prefix cache holds the prompt it ran a few rows (T(rows) came out
        # below one step's, and v(k) at 1.0: drafting looked free)
        if scores.forward:
            policy.observe_forward(scores.forward)
    return scores


def _observe_draft(policy: DraftLengthPolicy, k: int, proposal: Proposal, seconds: float, steady: bool,
                   observes: bool) -> None:
    """The policy learns a draft call's cost (`steady`: a round's, see _draft) and, where the draft's cache held
    the sequence (`observes`), how much of k a chain drafted."""
    if observes and proposal.parents is None:
        policy.observe_proposal(k, len(proposal.tokens))
    if steady and proposal.parents is None:
        policy.observe_draft(len(proposal.tokens), seconds, forward=proposal.forward)
    elif steady:
        policy.observe_draft(k, seconds, max(depths(proposal.parents)) + 1, proposal.forward)


def _drafted_in_verify(seq: _Sequence, req: GenerationRequest, proposer: Proposer, policy: DraftLengthPolicy,
                       asked: Proposal, scores: Scores, new_ids: list[int]
                       ) -> tuple[Proposal, list[int], tuple[int, ...] | None]:
    """A round a head in the target's process drafted in the verify call: the proposal (the cache length the
    ask reported), the verify's new tokens and tree with it; the policy learns its cost from the head's
    execution, and a proposer that keeps its proposals (lookup_first.py) is told it."""
    proposal = dataclasses.replace(scores.proposal, cached_length=asked.cached_length)
    seconds = proposal.forward.seconds if proposal.forward is not None else 0.0
    _observe_draft(policy, asked.ask.k, proposal, seconds, seq.ask_steady, seq.ask_observes)
    if getattr(proposer, "drafted_in_verify", None) is not None:
        proposer.drafted_in_verify(req.seq_id, proposal)
    new_ids = new_ids + proposal.tokens
    return proposal, new_ids, with_catch_up(len(new_ids) - len(proposal.tokens), proposal.parents)


def _learn(policy: DraftLengthPolicy, proposal: Proposal, verdict: TreeVerdict, depth: int | None) -> None:
    """The policy learns the proposer's acceptance: of a chain, or along a tree's first branch."""
    if depth is None:
        policy.update(len(proposal.tokens), len(verdict.path))
    else:
        policy.update(depth, len(verdict.path), (_first_branch_length(proposal.parents),
                                                 _on_first_branch(proposal.parents, verdict.path)))


def _accept(seq: _Sequence, proposal: Proposal, scores: Scores, verdict: TreeVerdict, new_ids: list[int],
            tree: tuple[int, ...] | None) -> list[int]:
    """The verdict's tokens (the accepted nodes, then the target's next token), appended to the sequence;
    what each model's cache keeps of the round, and a head's features at the positions the target keeps."""
    accepted = len(verdict.path)
    new = [proposal.tokens[node] for node in verdict.path] + [verdict.next_token]
    # A tree: the catch-up tokens and the accepted nodes are what the target's cache keeps of it
    caught_up = len(new_ids) - len(proposal.tokens)
    seq.path = None if tree is None else tuple(range(caught_up)) + tuple(caught_up + n for n in verdict.path)
    if seq.features is not None:  # the target's features at the positions it keeps
        if seq.path is None:
            seq.features.add(scores.features, seq.target_valid + len(new_ids), len(seq.tokens) + accepted)
        else:
            seq.features.add(rows_on(scores.features, len(new_ids), seq.path), len(seq.tokens) + accepted,
                             len(seq.tokens) + accepted)
    seq.target_valid = len(seq.tokens) + accepted
    # A proposer's cache holds its first branch (each node's first child): what it keeps of a tree
    # is the accepted path's part that follows it
    seq.draft_valid = min(seq.draft_valid, len(seq.tokens) + _on_first_branch(proposal.parents, verdict.path))
    seq.tokens += new
    if seq.occurrences is not None:
        seq.occurrences.add_output(new)
    return new


def _stops(seq: _Sequence, req: GenerationRequest, new: list[int]) -> tuple[list[int], str | None]:
    """The round's tokens up to where generation ends (an end token, max_tokens, the grammar complete), and
    why it ended (None: it goes on)."""
    end = seq.matcher.advance(new) if seq.matcher is not None else None  # the grammar complete: it ends here
    new, finish = _apply_stops(new if end is None else new[:end], req.end_ids, req.max_tokens - seq.generated,
                               req.min_tokens - seq.generated)
    if end is not None and len(new) == end:
        finish = tn.FINISH_STOP
    seq.generated += len(new)
    return new, finish


async def _score(scorer: Scorer, req: GenerationRequest, keep: int, new_ids: list[int], positions: int,
                 reserve: int, wait_for_room: Callable[[], Awaitable[bool]] | None,
                 allowed: torch.Tensor | None = None, want_features: bool = False,
                 tree: tuple[int, ...] | None = None, path: tuple[int, ...] | None = None,
                 score_rows: int = 0, ask: DraftAsk | None = None) -> Scores:
    """The verify call (`allowed`: the grammar's bitmask, for the target to pick with; `ask`: what a head in
    the target's process drafts first); a sequence's first one (reserve > 0) retries while the target has no
    room for it and `wait_for_room` says to."""
    # Greedy rounds ship no logits (the target sends its tokens' log-probabilities instead), unless
    # penalties, biases or bad words must edit them first (a grammar alone: the target picks with its mask).
    want_logits = not req.sampling.greedy or (req.edits_logits and allowed is None) or req.generation_logits or (
        req.context_logits and keep == 0)  # (the prompt's last row: its first verified position's)
    while True:
        try:
            return await scorer.score(VerifyCall(req.seq_id, keep, new_ids, positions, want_logits=want_logits,
                                                 reserve=reserve, want_log_probs=req.log_probs and not want_logits,
                                                 want_top_log_probs=req.top_log_probs > 0 and not want_logits,
                                                 allowed=allowed, want_features=want_features, tree=tree,
                                                 path=path, score_rows=score_rows,
                                                 score_top=score_rows > 0 and req.top_log_probs > 0,
                                                 score_logits=score_rows > 0 and req.context_logits,
                                                 adapter=req.lora_name, salt=req.cache_salt, draft=ask))
        except NoCapacity:
            if not reserve or wait_for_room is None or not await wait_for_room():
                raise


def _features_for(features: Features | None, draft_valid: int) -> dict:
    """propose's `features` argument: what a trained head reads, for proposers that want it."""
    if features is None:
        return {}
    return {"features": features.since(draft_valid)}


def _edited_logits(req: GenerationRequest, tokens: list[int], draft: list[int], logits: torch.Tensor | None,
                   occurrences: TokenOccurrences | None, matcher: Matcher | None = None) -> torch.Tensor | None:
    """The target's logits [k+1, V] under the request's logit bias and allowed tokens, its penalties
    (`occurrences`: its tokens so far), then its bans and its grammar (`matcher`: at the output so far; position j follows tokens + draft[:j]);
    unchanged when it has none of them, None when none were shipped."""
    if logits is None or not req.edits_logits:
        return logits
    if req.token_bias.active:
        logits = apply_bias(logits, req.token_bias)
    if occurrences is not None:
        positions, width = logits.shape
        logits = penalize(logits, *occurrences.rows(draft, positions, width, logits.device), req.penalties)
    if req.bad_words:
        logits = mask_banned(logits, banned_tokens(tokens, draft, req.bad_words, logits.shape[0]))
    if matcher is not None:
        logits = mask_disallowed(logits, matcher.allowed(draft, logits.shape[0]))
    return logits


def _within_grammar(proposal: Proposal, matcher: Matcher) -> Proposal:
    """The proposal cut before its first token the grammar refuses (for greedy or deterministic drafts)."""
    valid = matcher.valid_prefix(proposal.tokens)
    if valid == len(proposal.tokens):
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:valid]
    return Proposal(proposal.tokens[:valid], probs, proposal.cached_length)


def _verify(proposal: Proposal, scores: Scores, logits: torch.Tensor | None, params: SamplingParams,
            generator: torch.Generator | None) -> TreeVerdict:
    """The round's verdict from the target's (edited) logits: the accepted drafted tokens (a chain's
    first n, or a tree's path) and the next token; greedy rounds without logits use the tokens the target
    picked."""
    tokens, parents = proposal.tokens, proposal.parents
    if params.greedy:
        picked = (scores.greedy_tokens if logits is None else greedy(logits)).tolist()
        if parents is not None:
            return greedy_tree_verify(tokens, parents, picked)
        verdict = greedy_verify(tokens, picked)
        return TreeVerdict(tuple(range(verdict.num_accepted)), verdict.next_token)
    # Accept/reject where the target's logits are (on the GPU when the target handed them over there).
    target_probs = logits_to_probs(logits, params)
    device = target_probs.device
    k = len(tokens)
    draft = torch.tensor(tokens, dtype=torch.long, device=device)
    uniforms = torch.rand(k, generator=generator).to(device)
    if parents is not None:
        # Without distributions (prompt lookup, top-k) the children are point masses (tree_sampler.py).
        draft_probs = None if proposal.probs is None else proposal.probs.to(device)
        width = max(target_probs.shape[-1], 0 if draft_probs is None else draft_probs.shape[-1])
        return tree_rejection_sample(tokens, parents, pad_vocab(target_probs, width), uniforms,
                                     DETERMINISTIC if draft_probs is None else SAMPLED,
                                     None if draft_probs is None else pad_vocab(draft_probs, width), generator)
    if proposal.probs is None:
        # A deterministic draft (prompt lookup) is the one-hot distribution on its tokens: rejection
        # sampling then accepts with probability p_target(x) and resamples from the target without x.
        draft_probs = torch.nn.functional.one_hot(draft, target_probs.shape[-1]).float()
    else:
        draft_probs = proposal.probs.to(device)
    # The two models' logits may be of different widths (padded vocabularies): compare them as one.
    width = max(target_probs.shape[-1], draft_probs.shape[-1])
    verdict = rejection_sample(draft, pad_vocab(draft_probs, width), pad_vocab(target_probs, width), uniforms, generator)
    return TreeVerdict(tuple(range(verdict.num_accepted)), verdict.next_token)


def _width(policy: DraftLengthPolicy, proposer: Proposer, trees: bool) -> dict:
    """The proposer's `branches` for this round, when it could draft a tree: the policy's choice (a chain
    where the policy is narrower: a request's num_draft_branches), or a chain where trees are not verified."""
    return {"branches": policy.width if trees else 1} if getattr(proposer, "branches", 1) > 1 else {}


def _adapter(req: GenerationRequest, proposer: Proposer) -> dict:
    """The request's LoRA adapter for a proposer that drafts with one (an `adapts` attribute true: a draft model
    made of the target's layers may run it too, drafting as the adapted target writes), and its prefix-cache
    salt for one with a prefix cache (`salted`)."""
    options = {"adapter": req.lora_name} if req.lora_name and getattr(proposer, "adapts", False) else {}
    if req.cache_salt and getattr(proposer, "salted", False):  # a draft model's prefix cache is salted too
        options["salt"] = req.cache_salt
    return options


def _first_branch_length(parents: tuple[int, ...]) -> int:
    """The nodes of a tree's first branch (each node's first child, from the root)."""
    below, count, row = children(parents), 0, 0
    while below[row]:
        row, count = below[row][0] + 1, count + 1
    return count


def _on_first_branch(parents: tuple[int, ...] | None, path: tuple[int, ...]) -> int:
    """How many of the accepted path's first nodes are first children (all of a chain's)."""
    if parents is None:
        return len(path)
    below = children(parents)
    count = 0
    for node in path:
        if below[parents[node] + 1][0] != node:
            break
        count += 1
    return count


def _log_probs(scores: Scores, new: list[int], path: tuple[int, ...]) -> list[float]:
    """The target's log-probability of each of a round's tokens (its raw distribution, before penalties,
    bans and sampling's temperature and filters): the scored rows along the accepted path (a chain's
    first ones). Without logits (a greedy round): every token is the target's greedy token at its row,
    and the target sent their log-probabilities."""
    rows = [0] + [node + 1 for node in path]
    if scores.logits is None:
        return scores.log_probs[rows].tolist()
    return token_log_probs(scores.logits[rows], torch.tensor(new, dtype=torch.long)).tolist()


def _ranks(scores: Scores, new: list[int], path: tuple[int, ...]) -> list[int]:
    """Each of a round's tokens' rank in the target's raw distribution at its row (1 + the tokens with a
    larger logit: ties share the better rank). Without logits every token is the raw greedy choice (the
    target picks under a grammar only without ranks asked for): rank 1."""
    if scores.logits is None:
        return [1] * len(new)
    rows = scores.logits[[0] + [node + 1 for node in path]].float()
    chosen = rows.gather(-1, torch.tensor(new, dtype=torch.long, device=rows.device)[:, None])
    return ((rows > chosen).sum(-1) + 1).tolist()


def _top_log_probs(scores: Scores, path: tuple[int, ...], n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each of a round's tokens' n most likely tokens and their log-probabilities (the raw distribution, as
    _log_probs), along the accepted path: from the logits where they came, else as the target sent them."""
    rows = [0] + [node + 1 for node in path]
    if scores.logits is None:
        ids, values = scores.top_ids[rows, :n], scores.top_log_probs[rows, :n]
    else:
        ids, values = top_log_probs(scores.logits[rows], n)
    return ids.tolist(), values.tolist()


def _prompt_scores(scores: Scores, n: int, logits: bool = False) -> dict:
    """RoundOutput's prompt fields from a scoring round's Scores.scored (n: the top tokens asked for; logits:
    the prompt's logits too, its rows' and the first verified position's, its last)."""
    scored = scores.scored
    last = scores.logits[:1].float() if logits else None
    if scored is None:  # a one-token prompt: nothing to score
        return {"prompt_log_probs": [], "prompt_top": ([], []) if n else None, "prompt_ranks": [],
                "prompt_logits": last}
    top = (scored.top_ids[:, :n].tolist(), scored.top_log_probs[:, :n].tolist()) if n else None
    return {"prompt_log_probs": scored.log_probs.tolist(), "prompt_top": top, "prompt_ranks": scored.ranks.tolist(),
            "prompt_logits": torch.cat([scored.logits.float(), last]) if logits else None}


def _path_logits(scores: Scores, path: tuple[int, ...]) -> torch.Tensor:
    """(len(path) + 1, V) float32: the target's raw logits along the accepted path (a chain's rows or a tree's
    nodes) and at the position after it, the rows of the round's new tokens."""
    return scores.logits[[0] + [node + 1 for node in path]].float()


def _record(stats: Stats, k: int, accepted: int) -> None:
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += accepted
    if len(stats.accepted_per_position) < k:
        stats.accepted_per_position.extend([0] * (k - len(stats.accepted_per_position)))
    for i in range(accepted):
        stats.accepted_per_position[i] += 1


def _apply_stops(new: list[int], end_ids: frozenset[int], budget: int, min_index: int = 0
                 ) -> tuple[list[int], str | None]:
    """Cut a round's tokens at the first end-of-sequence token (dropped) at or after new[min_index], or at
    the token budget."""
    for i, token in enumerate(new):
        if token in end_ids and min_index <= i < budget:
            return new[:i], tn.FINISH_STOP
    if len(new) >= budget:
        return new[:budget], tn.FINISH_LENGTH
    return new, None
