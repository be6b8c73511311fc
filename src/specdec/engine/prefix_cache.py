"""Prefix caching: full KV blocks found again by the tokens they hold, so a new sequence whose prompt
starts like an earlier one (a shared system prompt, few-shot examples, the conversation so far in a
chat's next turn) reuses those blocks instead of running the prefix through the model again.

A block's key is (its parent's serial, its block_size tokens): the parent is the entry of the block
before it, so a key names the whole prefix up to the block's end at the same positions, exactly (the
token tuples are compared, not hashed digests: no collision can hand a sequence another prompt's keys
and values). Every registration gets a new serial, so when a block is evicted and its number reused,
the entries that followed it can no longer be reached: lookups walk from the root.

This module is the index (which block holds which prefix) and the state both KV stores keep of a
sequence (`SequenceState`). The paged store's pool (paged_kv.BlockPool) owns its blocks,
counts the sequences holding each, and keeps the registered blocks nobody holds as an LRU it evicts from
when free blocks run out; the rule that keeps a shared block's contents right is that a registered or
shared block is never written (a sequence that rolls back into one first takes a copy). The contiguous
store, whose sequences own growable buffers, copies keyed blocks into a store of its own and out of it
(kv_cache.BlockStore).

Where the target serves a trained head (its forward returns the hidden states of the layers the head reads),
the index also keeps those states at a registered block's positions when the forward that keyed it computed
them: a head's request needs the features of every prompt position, and with them it takes cached blocks
like any other request instead of running its whole prompt. A block keyed later (a generated one,
confirmed a round after its forward) has none, and a head's prompt reuses the blocks before it. The
features kept take at most FEATURES_SHARE of the memory of the store's blocks (a store sets
`features_budget`; a head's layers are 15-19 % of a block's keys and values on the pairs measured): past it
the oldest go first, and a head's prompt runs their blocks again.
"""

from __future__ import annotations

import torch

ROOT = 0  # the parent serial of a sequence's first block
FEATURES_SHARE = 0.1  # the features kept, at most this share of the bytes of the store's blocks


class SequenceState:
    """What either KV store keeps of one sequence besides its keys and values (kv_cache.SequenceKV,
    paged_kv.PagedSequence): the first `length` positions are valid; when it last ran (idle
    eviction); with prefix caching, the token at each position (-1 where a drafted token is not yet known
    on the host), the serials of its leading blocks keyed in the index, and whether its prompt is still
    arriving in chunks (looked up in the index while it is)."""

    def __init__(self):
        self.length = 0
        self.last_used = 0.0
        self.tokens: list[int] = []
        self.chain: list[int] = []
        self.prefilling = True
        self.cached = 0  # of its tokens, those found in the prefix cache (not run): what its request reports
        # Its LoRA adapter (lora.AdapterSet's slot; 0: the base model), fixed at its first step. Its keys and
        # values are that adapter's: its blocks are keyed under a root of their own (`root`), by the
        # adapter's key (AdapterSet.key: a slot that takes another adapter takes another key).
        self.adapter = 0
        self.adapter_key = 0
        # Its prefix-cache salt (Step.salt), fixed at its first step: its blocks are keyed under a root of
        # that salt's ("": the shared root)
        self.salt = ""
        # After a step whose new tokens were a tree (`Step.tree`): (the position it started at, its parents,
        # its tokens where the host knows them), which the next step's `Step.path` picks from; else None.
        self.tree: tuple[int, tuple[int, ...], list[int] | None] | None = None


def root(seq: SequenceState) -> int | tuple[int, str]:
    """The parent serial of seq's first block: ROOT, or below it one per LoRA adapter loaded (serials count up
    from ROOT + 1), so that a prompt finds only blocks its own adapter computed; with a salt, that root and
    the salt (a key no serial equals), so that it finds only blocks of its own salt."""
    parent = ROOT - seq.adapter_key
    return (parent, seq.salt) if seq.salt else parent


class PrefixIndex:
    """Registered blocks by key; each registered block's key and serial."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self._entries: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}  # block -> (key, serial)
        self._next_serial = ROOT + 1
        self._features: dict[int, torch.Tensor] = {}  # serial -> (block_size, layers, H), oldest first
        self.features_bytes = 0
        self.features_budget: int | None = None  # bytes (None: no limit); the store's FEATURES_SHARE

    def __len__(self) -> int:
        return len(self._entries)

    def registered(self, block: int) -> bool:
        return block in self._entries

    def match(self, tokens: list[int], max_blocks: int, parent: int = ROOT) -> tuple[list[int], list[int]]:
        """The registered blocks holding tokens[:n * block_size] after the prefix `parent` (the whole
        prefix before them: ROOT for a prompt's start) for the largest n <= max_blocks, and their serials
        (the chain a sequence that takes them continues from)."""
        blocks, serials, size = [], [], self.block_size
        for j in range(max_blocks):
            block = self._blocks.get((parent, tuple(tokens[j * size:(j + 1) * size])))
            if block is None:
                break
            parent = self._entries[block][1]
            blocks.append(block)
            serials.append(parent)
        return blocks, serials

    def find(self, parent: int, tokens: tuple[int, ...]) -> tuple[int, int] | None:
        """The registered block holding `tokens` after the prefix `parent` ends, and its serial, if any."""
        block = self._blocks.get((parent, tokens))
        return None if block is None else (block, self._entries[block][1])

    def add(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Register `block` as holding `tokens` after the prefix whose last block has serial `parent`;
        returns the serial its successor names as parent. If another block already holds that prefix,
        `block` stays unregistered (a duplicate, freed with its sequence) and that block's serial is
        returned, so the sequence's chain goes on."""
        key = (parent, tokens)
        existing = self._blocks.get(key)
        if existing is not None:
            return self._entries[existing][1]
        serial = self._next_serial
        self._next_serial += 1
        self._blocks[key] = block
        self._entries[block] = (key, serial)
        return serial

    def keep_features(self, serial: int, rows: torch.Tensor) -> None:
        """The target's features (block_size, layers, H) at the positions of the registered block `serial`
        names (a copy: a forward's outputs may live in buffers it reuses)."""
        if serial in self._features:
            return
        self._features[serial] = rows = rows.clone()
        self.features_bytes += rows.nbytes
        while self.features_budget is not None and self.features_bytes > self.features_budget:
            self.features_bytes -= self._features.pop(next(iter(self._features))).nbytes

    def features(self, serials: list[int]) -> list[torch.Tensor]:
        """The kept features of these blocks (a chain from `match`), in order, up to the first without."""
        out = []
        for serial in serials:
            rows = self._features.get(serial)
            if rows is None:
                break
            out.append(rows)
        return out

    def clear(self) -> list[int]:
        """Forget every registered block (a reset: later prompts find none of them) and the features kept with
        them; returns the blocks. Serials go on counting: the chain of a sequence still running names a parent
        that no entry has, so the blocks it keys later are found by no prompt's lookup from the root."""
        blocks = list(self._entries)
        self._blocks.clear()
        self._entries.clear()
        self._features.clear()
        self.features_bytes = 0
        return blocks

    def remove(self, block: int) -> None:
        """Forget what `block` holds (it is evicted or about to be written); its successors' entries
        become unreachable and age out of the LRU like any unused block."""
        key, serial = self._entries.pop(block)
        del self._blocks[key]
        rows = self._features.pop(serial, None)
        if rows is not None:
            self.features_bytes -= rows.nbytes
