"""The types the decode loop exchanges with its proposer (draft side) and scorer (target side).

Kept apart from the loop so that a proposer or scorer implementation imports these and never the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from specdec.decoding.sampling import SamplingParams


class ForwardStats(NamedTuple):
    """The batched execution a call ran in (the target's forward; the draft's whole call): what the
    draft-length policy's cost model learns from."""

    rows: int  # token rows in that forward (every sequence's new tokens, packed)
    sequences: int  # sequences sharing it
    seconds: float  # its wall time


@dataclass(frozen=True)
class DraftAsk:
    """A round's draft for a head in the target's own process (engine/hosted_heads.py): the verify call
    drafts it first, then verifies it in the same forward, and returns it with the scores (Scores.proposal).
    k = 0 drafts nothing (the target still keeps the features the head will read)."""

    head: str  # the hosted head's name
    k: int
    params: SamplingParams = SamplingParams()
    seed: int | None = None  # the round's seed for the head's generator (sampled requests)
    branches: int = 1  # candidates per drafted position: above 1 a tree of at most k nodes


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # up to K draft tokens (a proposer may offer fewer, or none)
    # (len(tokens), V_draft) processed draft distributions; None when greedy, or for a deterministic draft
    # (sampling then verifies one-hot rows). For a tree: (len(tokens) + 1, V_draft), row r the distribution
    # the children of row r (0: the root, i + 1: token i) were drawn from without replacement
    probs: torch.Tensor | None
    cached_length: int  # tokens the proposer's cache holds after the call (its valid prefix)
    # A tree of candidates (tree_sampler.py): parents[i] is token i's parent, an earlier token, or -1 where
    # it follows the sequence. None: a chain. Of a tree, a proposer's cache (cached_length) may hold only
    # the first branch (each node's first child), as a chain's.
    parents: tuple[int, ...] | None = None
    forward: ForwardStats | None = None  # the draft's batched execution this call ran in, where reported
    # The call also caught up on rounds the proposer's model did not draft (lookup_first.py): its time is not
    # what a round's draft costs, and the loop does not time it
    caught_up: bool = False
    # A head in the target's process drafts this round in the verify call (tokens empty until it has)
    ask: DraftAsk | None = None


@dataclass(frozen=True)
class VerifyCall:
    """One verify call to the scorer: keep `keep` cached tokens, append `new_ids`, score the last
    `num_positions` positions."""

    seq_id: int
    keep: int
    new_ids: list[int]
    num_positions: int
    want_logits: bool = False  # the (num_positions, V) logits back (sampling, or logits edited on the host)
    # On a sequence's first call: the room its whole generation needs (positions), which a model with a KV
    # budget sets aside then or raises NoCapacity
    reserve: int = 0
    want_log_probs: bool = False  # the greedy tokens' log-probabilities back
    # and each position's tn.MAX_TOP_LOG_PROBS most likely tokens with theirs (Scores.top_ids / top_log_probs)
    want_top_log_probs: bool = False
    # (num_positions, words) int32 bitmask (grammar.GrammarMatcher.allowed): each greedy token is the best of
    # its position's allowed tokens (structured output, picked where the logits are)
    allowed: torch.Tensor | None = None
    # the target's features at the new positions back (a trained head drafts from them; Scores.features)
    want_features: bool = False
    # new_ids as a tree (engine Step.tree: each token's parent among new_ids, or -1): a tree of candidates
    # after the tokens the cache lacks. num_positions then counts the last new_ids (a node's row each).
    tree: tuple[int, ...] | None = None
    # The previous call was a tree and these of its new_ids were accepted (root to leaf): they become the
    # cache's positions after that call's `keep` (engine Step.path)
    path: tuple[int, ...] | None = None
    # The score_rows positions before the last num_positions are scored too (a prompt whose log-probabilities
    # were asked for): at each, the log-probability of the new token after it (Scores.scored). A chain only.
    score_rows: int = 0
    score_top: bool = False  # and each scored position's tn.MAX_TOP_LOG_PROBS most likely tokens
    score_logits: bool = False  # and each scored position's (V,) logits (ScoredRows.logits)
    adapter: str = ""  # the LoRA adapter the scorer runs for the sequence (GenerationRequest.lora_name)
    salt: str = ""  # the sequence's prefix-cache salt (GenerationRequest.cache_salt)
    # A head in the target's process drafts this round's proposal first, appended to new_ids and verified
    # with them: num_positions and tree count only the tokens sent (Scores.proposal says what was drafted)
    draft: DraftAsk | None = None


class ScoredRows(NamedTuple):
    """VerifyCall.score_rows' answer: row r is the position before new token r + 1 of the scored ones."""

    log_probs: torch.Tensor  # (score_rows,) float32: each next token's log-probability (the raw logits')
    ranks: torch.Tensor  # (score_rows,) int64: each next token's rank (1 + the tokens more likely)
    top_ids: torch.Tensor | None  # (score_rows, tn.MAX_TOP_LOG_PROBS) int64, with want_top_log_probs
    top_log_probs: torch.Tensor | None  # (score_rows, tn.MAX_TOP_LOG_PROBS) float32, the same
    logits: torch.Tensor | None = None  # (score_rows, V), with VerifyCall.score_logits


@dataclass(frozen=True)
class Scores:
    greedy_tokens: torch.Tensor  # (K+1,) target argmax at each verified position (among the allowed tokens)
    logits: torch.Tensor | None  # (K+1, V) target logits; requested only when sampling
    forward: ForwardStats | None = None  # None where the scorer does not report its forwards
    # (K+1,) float32: each greedy token's log-probability (log-softmax of the raw logits), when asked for
    log_probs: torch.Tensor | None = None
    # (rows, F): with want_features, the target's features (the chosen layers' states, concatenated) at the
    # call's last `rows` new positions (all of them, unless a prefix cache served the first ones)
    features: torch.Tensor | None = None
    # (K+1, tn.MAX_TOP_LOG_PROBS) int64 / float32: with want_top_log_probs, each row's most likely tokens and
    # their log-probabilities, most likely first (sampling.top_log_probs of the raw logits)
    top_ids: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    scored: ScoredRows | None = None  # with VerifyCall.score_rows
    # A sequence's first call (keep = 0; its prompt): of the sequence's tokens, those the scorer's prefix cache
    # held (not run); None where the scorer does not say
    cached_tokens: int | None = None
    block_size: int = 0  # the tokens of the scorer's KV block (its prefix cache's unit); 0: unknown
    # With VerifyCall.draft: what the hosted head drafted (its forward: the head's execution), verified
    # after the call's new_ids; the rows above (K+1 of them) count its tokens
    proposal: Proposal | None = None


class NoCapacity(RuntimeError):
    """A model has no room for a new sequence now (its KV budget or sequence limit is reached): the same
    call can succeed once other sequences end."""


class Proposer(Protocol):
    # A trained head's proposer sets this: the loop then asks the target for its features and hands them
    # to propose (`features`: (rows, F) at the rows positions before new_ids' last token)
    wants_features: bool = False
    # A head in the target's process (its name there): the loop never calls propose, it sends the round's
    # DraftAsk with the verify call
    hosted: str = ""

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int,
                      params: SamplingParams, round_seed: int, reserve: int = 0, **features) -> Proposal:
        """Keep `keep` cached tokens, append `new_ids`, draft up to k tokens. On a sequence's first call
        `reserve` is the room its whole generation needs (positions), which a model with a KV budget
        sets aside then or raises NoCapacity. A proposer that drafts trees (a `branches` attribute above
        1) also takes `branches=`: this round's candidates per position, at most its own (1: a chain)."""

    async def release(self, seq_id: int) -> None: ...


class HostedProposer:
    """A trained head in the target's own process (engine/hosted_heads.py), named `hosted` there: its
    proposal is drafted in the round's verify call, so `propose` returns only what to ask for (Proposal.ask);
    the target releases the head's side of a sequence with its own."""

    wants_features = False

    def __init__(self, hosted: str, branches: int = 1):
        self.hosted, self.branches = hosted, branches

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                      round_seed: int, reserve: int = 0, branches: int | None = None, **_options) -> Proposal:
        width = self.branches if branches is None else max(1, min(branches, self.branches))
        # the cache it reports is a head's (all but the last token): the tokens sent next are the target's to hold
        return Proposal([], None, keep + len(new_ids) - 1,
                        ask=DraftAsk(self.hosted, k, params, round_seed if not params.greedy else None, width))

    async def release(self, seq_id: int) -> None:
        pass


class Scorer(Protocol):
    async def score(self, call: VerifyCall) -> Scores:
        """Run the verify call (see `VerifyCall`)."""

    async def release(self, seq_id: int) -> None: ...
