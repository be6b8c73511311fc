"""The types the executor exchanges: a step it takes, a proposal it returns, and the two parts it is
composed of (a KV store and a forward), as protocols each implementation follows."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from specdec.decoding.sampling import SamplingParams
from specdec.engine.prefix_cache import PrefixIndex, SequenceState


class Step(NamedTuple):
    """One sequence's part of a batched call: keep `keep` cached tokens, append `new_ids`."""

    seq_id: int
    keep: int
    new_ids: list[int]
    num_logits: int = 1  # extend: logits of the last num_logits new positions
    k: int = 0  # propose: tokens to draft
    params: SamplingParams = SamplingParams()
    generator: torch.Generator | None = None
    # A new sequence's room for its whole generation, taken at its first step (so that a sequence that
    # starts can finish): positions, or 0 for just this step's. Ignored once the sequence exists.
    reserve: int = 0
    # extend, read by whoever picks tokens from the logits (not the forward): (num_logits - score_rows, words)
    # int32 bitmask of the tokens each position's greedy pick may take (grammar.GrammarMatcher.allowed)
    allowed: torch.Tensor | None = None
    # extend, read by whoever reads the logits (not the forward): the first score_rows of the num_logits rows
    # score the new token after each (a prompt's log-probabilities, decoding/interfaces.VerifyCall.score_rows);
    # the positions picked from are the rest
    score_rows: int = 0
    # the token after new_ids, which the last score row scores when no position follows it (a prompt's chunk)
    score_next: int = -1
    # extend: the new tokens as a tree of candidates, not a chain: tree[i] is the index in new_ids of token
    # i's parent (before i), or -1 where it follows the cached tokens. Each token attends to the cache and to
    # its ancestors, at the position after its parent's. None: a chain.
    tree: tuple[int, ...] | None = None
    # extend and propose: the sequence's previous step was a tree, and these of its nodes (indices into that
    # step's new tokens, root to leaf) were accepted: their keys and values move to the positions right
    # after the tree's start before anything else, and `keep` counts them (at most start + len(path)).
    path: tuple[int, ...] | None = None
    # propose: candidates per drafted position; above 1 the proposal is a tree of at most k nodes
    # (decoding/draft_tree.py): the chain drafted and the draft's next candidates beside it
    branches: int = 1
    # extend: the features of every new position are wanted (a head reads them): a prefix cache's blocks are
    # taken only where their features are kept, and returned with the features the forward computes
    whole: bool = False
    # propose, for a trained head (head_executor.py): (rows, F) the target's features at the rows positions
    # before the last new token (fewer than it needs: the first ones are missing)
    features: torch.Tensor | None = None
    # extend, where the target's process hosts heads (hosted_heads.py): the head that drafts k tokens (with
    # params, generator and branches) to append to new_ids before the forward verifies them; "": none
    draft_head: str = ""
    # a new sequence's LoRA adapter by name ("": the base model), taken at its first step (lora.AdapterSet
    # gives it a slot, reading it from its directory if it is not held)
    adapter: str = ""
    # a new sequence's prefix-cache salt, taken at its first step: its blocks are found only by sequences of
    # the same salt (and adapter), so that one tenant cannot time another's prompts ("": the shared cache)
    salt: str = ""


class Scored(NamedTuple):
    """One sequence's part of `extend_many(..., with_hidden=True)`."""

    logits: torch.Tensor  # (num_logits, V)
    # (rows, len(hidden_layers), H) at every new position the forward ran, and with Step.whole at the cached
    # positions the step took before them (without it a prefix cache's tokens are not run: the rows are the
    # step's last ones): each chosen layer's output as transformers' hidden_states
    # give it (the residual stream after layer l; the last layer's after the final norm)
    hidden: torch.Tensor


class ForwardOutput(NamedTuple):
    logits: list[torch.Tensor]  # per sequence (num_logits, V)
    hidden: list[torch.Tensor] | None  # per sequence (new rows, len(hidden_layers), H); None without layers


class Drafted(NamedTuple):
    """One sequence's proposal: what `propose` returns."""

    tokens: list[int]  # the drafted tokens
    probs: torch.Tensor | None  # (len(tokens), V) processed draft distributions when sampling, else None
    cached_length: int  # tokens the sequence's cache holds after the call (its valid prefix)
    # A tree (Step.branches > 1): each token's parent (-1: the root); probs then has a row more, row r the
    # distribution row r's children were drawn from (0: the root, i + 1: token i; zeros for a leaf). None: a chain
    parents: tuple[int, ...] | None = None


class KVStore(Protocol):
    """Where sequences' keys and values live (kv_cache.ContiguousKV, paged_kv.PagedKV)."""

    prefix: PrefixIndex | None  # prefix caching's index; None: off
    block_size: int  # tokens per block: the prefix cache's unit (and the paged pool's)

    def new_sequence(self) -> SequenceState: ...
    def reserve(self, seq, positions: int) -> None: ...  # room for positions tokens, or CacheError
    def hold(self, seq, positions: int) -> None: ...  # a new sequence's whole generation, or CapacityError
    def adopt(self, seq, blocks: list[int], first: int) -> None: ...  # keyed blocks become seq's
    def key_blocks(self, seq, first: int, parent: int, blocks: list[tuple[int, ...]]) -> list[int]: ...
    def rewrite_from(self, seq, j: int) -> None: ...  # seq writes into its blocks from j on next
    def move(self, seq, source: list[int], target: list[int]) -> None: ...  # entries at positions source to target
    def release(self, seq) -> None: ...
    def reset_prefix_cache(self) -> int: ...  # every cached prefix forgotten (held blocks stay held): how many
    def bytes_held(self, sequences) -> int: ...
    prefix_cache_bytes: int


class Forward(Protocol):
    """Runs the model over new rows of several sequences (TransformersForward, StaticForward)."""

    hidden_layers: tuple[int, ...]  # layers whose output (the residual stream) a forward also returns
    max_tree_rows: int | None  # the largest tree a row may be (`Step.tree`); None: any

    def __call__(self, seqs: list, rows: list, num_logits: list[int],
                 trees: list[tuple[int, ...] | None] | None = None) -> ForwardOutput:
        """seqs[b]'s new tokens rows[b] (ids, or a 1-D tensor of ids on the device) written to its cache
        after its seqs[b].length cached ones, as a chain or as the tree trees[b]; returns per sequence the
        logits (num_logits[b], V) of its last new positions, and the hidden states of `hidden_layers` at
        every new position. The caller moves the lengths on."""

    def warm_up(self, time_budget_s: float) -> tuple[int, float]: ...  # (buckets captured, seconds)
    def summary(self, ready: int, seconds: float) -> str: ...  # a log line: what runs, what was captured
