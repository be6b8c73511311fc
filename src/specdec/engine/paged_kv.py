"""The paged KV store: one pool of fixed-size blocks per layer, allocated once within a budget, from which
sequences hold lists of blocks (the static forward's, `static_forward.py`).

KV memory is one pool per layer, (blocks + 1, block_size, kv_heads, head_dim), allocated at load within
a budget (`kv_pool_tokens`); a sequence holds a list of blocks, grown as it grows and returned when it
ends. Rolling back rejected draft tokens is just a smaller length. The extra block is scratch: padding
rows write there and nobody reads it. A new sequence takes the blocks of its whole generation at its
first step (`Step.reserve`, up to the context), so one that starts can finish; a step that needs blocks
when too few are free fails with a CapacityError naming the budget (the sequence keeps what it had).
With prefix caching, sequences whose prompts begin alike hold the same full blocks, and the blocks of
ended prompts stay cached until the pool needs them (`prefix_cache.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from specdec import tensor_names as tn
from specdec.engine.errors import CacheError, CapacityError
from specdec.engine.kv_cache import kv_layout
from specdec.engine.prefix_cache import FEATURES_SHARE, PrefixIndex, SequenceState


class PagedSequence(SequenceState):
    """One sequence in the pool: its blocks, in order."""

    def __init__(self):
        super().__init__()
        self.blocks: list[int] = []


class BlockPool:
    """Per layer keys and values (blocks + 1, block_size, kv_heads, head_dim); the last block is scratch.

    The memory is reserved, not written, at load (on CPU the pages are not even resident until used); a
    block is zeroed the first time it is handed out. Attention masks the positions past a sequence's
    length, but a masked weight of 0 times garbage that happens to be NaN is still NaN: the keys and
    values it reads must be finite, which stale entries of a reused block are.

    With a prefix index, a block may be held by several sequences (`refs`), and a registered block that
    no sequence holds any more stays `cached` (its contents reusable by a later prompt) until the pool
    needs it: free blocks are handed out first, then cached ones, least recently released first. With
    `max_cached` at most that many stay cached (the oldest beyond it are freed): free blocks are a stack, so
    those are reused before a block never touched, and the pool's resident pages stay near what the sequences
    held at most plus the cap, where otherwise every block of the pool ends up cached and resident."""

    def __init__(self, num_layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, index: PrefixIndex | None = None,
                 max_cached: int | None = None):
        shape = (blocks + 1, block_size, kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size, self.blocks, self.scratch = block_size, blocks, blocks
        self.free = list(range(blocks - 1, -1, -1))  # a stack: recently freed blocks are reused first
        self.zeroed = [False] * blocks
        self.index = index
        self.refs = [0] * blocks  # sequences holding each block
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered, held by none: oldest first
        self.max_cached = blocks if max_cached is None else max_cached
        self._zero([self.scratch])
        # Read on every execute (the KV-bytes gauge): computed once, not from 2 x layers tensor views.
        self.block_bytes = 2 * sum(k[0].nbytes for k in self.keys)

    @property
    def held(self) -> int:
        """Blocks that sequences hold (a shared one counts once)."""
        return self.blocks - len(self.free) - len(self.cached)

    def _zero(self, blocks: list[int]) -> None:
        # One write per buffer for all of them: a new sequence takes its whole reservation at once, and
        # on a GPU a write per block and buffer would be thousands of launches for a long generation.
        index = torch.tensor(blocks, device=self.keys[0].device)
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer.index_fill_(0, index, 0)

    def _take(self, count: int) -> list[int]:
        """`count` blocks for a sequence's own use (CapacityError, nothing taken, if there are fewer)."""
        if count > len(self.free) + len(self.cached):
            raise CapacityError(
                f"KV cache budget full: {count} more blocks of {self.block_size} tokens needed, "
                f"{len(self.free) + len(self.cached)} of {self.blocks} free (kv_pool_tokens={self.blocks * self.block_size}); "
                f"{tn.RETRY_LATER}")
        taken = [self.free.pop() for _ in range(min(count, len(self.free)))]
        while len(taken) < count:  # evict the least recently used cached prefixes
            taken.append(self._evict_oldest())
        fresh = [block for block in taken if not self.zeroed[block]]
        if fresh:
            self._zero(fresh)
            for block in fresh:
                self.zeroed[block] = True
        for block in taken:
            self.refs[block] = 1
        return taken

    def grow(self, seq: PagedSequence, positions: int) -> None:
        """Give seq enough blocks for `positions` tokens, or raise CapacityError (seq unchanged)."""
        needed = -(-positions // self.block_size) - len(seq.blocks)
        if needed > 0:
            seq.blocks += self._take(needed)

    def share(self, seq: PagedSequence, blocks: list[int], first: int = 0) -> None:
        """seq's blocks first, first + 1, ... become these registered blocks, which other sequences may
        hold; the private blocks it had there (reserved, not written yet) go back to the free list."""
        for j, block in enumerate(blocks, first):
            self.refs[block] += 1
            self.cached.pop(block, None)
            if j < len(seq.blocks):
                self.refs[seq.blocks[j]] -= 1
                self.free.append(seq.blocks[j])
                seq.blocks[j] = block
            else:
                seq.blocks.append(block)

    def make_private(self, seq: PagedSequence, j: int) -> None:
        """Before seq writes into its block j: a block other sequences hold is replaced by a copy of its
        own, and a registered one it holds alone leaves the index (its contents are about to change)."""
        block = seq.blocks[j]
        if self.refs[block] > 1:
            (copy,) = self._take(1)
            for buffer in self.keys + self.values:
                buffer[copy] = buffer[block]
            self.refs[block] -= 1
            seq.blocks[j] = copy
        elif self.index is not None and self.index.registered(block):
            self.index.remove(block)

    def forget_prefixes(self) -> int:
        """A prefix-cache reset: the index forgets every block; those no sequence holds are free again, those
        sequences hold stay theirs (released, they go to the free list). Returns the blocks forgotten."""
        forgotten = self.index.clear()
        self.free += list(self.cached)
        self.cached.clear()
        return len(forgotten)

    def release(self, seq: PagedSequence) -> None:
        # Last blocks first: a released prompt's tail is evicted before its head, which more prompts share.
        for block in reversed(seq.blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if self.index is not None and self.index.registered(block):
                self.cached[block] = None
            else:
                self.free.append(block)
        seq.blocks = []
        while len(self.cached) > self.max_cached:  # the oldest beyond the cap, freed
            self.free.append(self._evict_oldest())

    def _evict_oldest(self) -> int:
        """The least recently released cached block, out of the cache and the index."""
        block, _ = self.cached.popitem(last=False)
        self.index.remove(block)
        return block


class PagedKV:
    """A KV store over a `BlockPool` on the model's device.

    kv_pool_tokens: the pool's size in tokens; 0 derives it from max_sequences * max_context, capped at
    kv_memory_fraction of the device's free memory (host memory on CPU). max_context: the most positions
    one sequence may hold (and at least what the pool must hold). prefix_caching: a new sequence reuses
    the pool's blocks that hold its prompt's first tokens; their keys and values are those its own
    prefill would write. prefix_cache_tokens: at most this many tokens' blocks kept for later prompts while
    no sequence holds them (None: every block the sequences leave free; see BlockPool)."""

    def __init__(self, model, max_sequences: int = 256, max_context: int = 8192, kv_pool_tokens: int = 0,
                 kv_memory_fraction: float = 0.4, block_size: int = 32, prefix_caching: bool = True,
                 log: Callable[[str], None] = lambda message: None, prefix_cache_tokens: int | None = None):
        layers, kv_heads, head_dim = kv_layout(model)
        device = model.device
        self.block_size = block_size
        self.max_context = min(max_context, getattr(model.config, "max_position_embeddings", max_context) or max_context)
        bytes_per_token = 2 * layers * kv_heads * head_dim * model.dtype.itemsize
        if not kv_pool_tokens:
            kv_pool_tokens = min(max_sequences * self.max_context,
                                 int(kv_memory_fraction * _free_memory(device)) // bytes_per_token)
        blocks = kv_pool_tokens // block_size
        if blocks * block_size < self.max_context:
            raise ValueError(
                f"the KV pool ({kv_pool_tokens} tokens, {kv_pool_tokens * bytes_per_token / 2**20:.0f} MiB) "
                f"cannot hold one sequence of max_context={self.max_context} tokens: raise kv_pool_tokens or the memory")
        # The pool holds the cached prefixes (in its blocks no sequence needs): no store of their own.
        self.prefix = PrefixIndex(block_size) if prefix_caching else None
        cached = None if prefix_cache_tokens is None else min(blocks, prefix_cache_tokens // block_size)
        self.pool = BlockPool(layers, blocks, block_size, kv_heads, head_dim, model.dtype, device, self.prefix,
                              cached)
        if self.prefix is not None:  # a served head's features kept with the blocks (prefix_cache.py)
            self.prefix.features_budget = int(FEATURES_SHARE * self.pool.max_cached * self.pool.block_bytes)
        capped = "" if self.prefix is None or cached is None else f"; prefixes cached in at most {cached} of them"
        log(f"KV pool: {blocks} blocks of {block_size} tokens ({blocks * block_size} tokens, "
            f"{blocks * self.pool.block_bytes / 2**30:.2f} GiB) on {device}{capped}")

    def new_sequence(self) -> PagedSequence:
        return PagedSequence()

    def reserve(self, seq: PagedSequence, positions: int) -> None:
        """Blocks for `positions` tokens (CacheError beyond the context, CapacityError if the pool is full)."""
        if positions > self.max_context:
            raise CacheError(f"{positions} tokens exceed the context of {self.max_context}")
        self.pool.grow(seq, positions)

    def hold(self, seq: PagedSequence, positions: int) -> None:
        """A new sequence's generation: its blocks taken now. One longer than the context fails when it
        gets there, not at its start."""
        self.pool.grow(seq, min(positions, self.max_context))

    def adopt(self, seq: PagedSequence, blocks: list[int], first: int) -> None:
        self.pool.share(seq, blocks, first)  # no copy: the blocks are held by one more sequence

    def key_blocks(self, seq: PagedSequence, first: int, parent: int, blocks: list[tuple[int, ...]]) -> list[int]:
        serials = []
        for j, tokens in enumerate(blocks, first):  # no copy: the pool's block itself is keyed
            parent = self.prefix.add(seq.blocks[j], parent, tokens)
            serials.append(parent)
        return serials

    def rewrite_from(self, seq: PagedSequence, j: int) -> None:
        # Shared or keyed blocks are never written: the sequence takes a copy, or the index lets go.
        for index in range(j, len(seq.chain)):
            self.pool.make_private(seq, index)

    def move(self, seq: PagedSequence, source: list[int], target: list[int]) -> None:
        """The keys and values at positions `source` copied to positions `target` (an accepted tree path to
        where a chain would have put it), every layer. The target blocks were written by the tree's own
        forward, so they are the sequence's own (`rewrite_from` made them so)."""
        size, device = self.pool.block_size, self.pool.keys[0].device
        blocks = torch.tensor(seq.blocks, device=device)
        src, dst = torch.tensor(source, device=device), torch.tensor(target, device=device)
        src_block, src_offset = blocks[src // size], src % size
        dst_block, dst_offset = blocks[dst // size], dst % size
        for buffer in self.pool.keys + self.pool.values:
            buffer[dst_block, dst_offset] = buffer[src_block, src_offset]

    def release(self, seq: PagedSequence) -> None:
        self.pool.release(seq)

    def reset_prefix_cache(self) -> int:
        return self.pool.forget_prefixes() if self.prefix is not None else 0

    def bytes_held(self, sequences) -> int:
        """Bytes of the pool's blocks that sequences hold (cached prefixes that none holds are not counted:
        they make room whenever it is needed)."""
        return self.pool.held * self.pool.block_bytes

    @property
    def prefix_cache_bytes(self) -> int:
        return len(self.pool.cached) * self.pool.block_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the whole pool: what bytes_held is a share of."""
        return self.pool.blocks * self.pool.block_bytes


CGROUP_MEMORY = Path("/sys/fs/cgroup")


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:  # MemAvailable: what can be had without swapping
        fields = dict(line.split(":", 1) for line in meminfo)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    # In a container with a memory limit (a Kubernetes pod's) the machine's memory is not the process's:
    # what the limit leaves (cgroup v2). On the CPU the pool is host memory, touched as blocks are first used.
    try:
        limit = CGROUP_MEMORY.joinpath("memory.max").read_text().strip()
        if limit != "max":
            used = int(CGROUP_MEMORY.joinpath("memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available
