"""The contiguous KV store: per-sequence KV buffers, and the attention that appends to them and reads
them in place (the eager forward's, `transformers_forward.py`).

Each sequence owns one preallocated key and value buffer per layer, (kv_heads, capacity, head_dim),
grown by doubling. A forward step writes its new tokens' keys and values at [length, length + width)
and attends over [0, length + width) of the same buffer: nothing is concatenated or copied per step
(Hugging Face's DynamicCache concatenates every layer's whole cache on every step, and a batch of
sequences with different lengths would need their caches copied into one padded tensor and back).
Rolling back rejected draft tokens is just a smaller `length`: the stale entries are overwritten by the
next step's writes.

Several sequences' steps run as one packed forward: their new tokens sit back to back in a single row
(no padding to a common width, so a 9-token verify next to 1-token steps costs 9 + 1 + ... rows, not
9 per sequence); the projections, MLPs and head run over all of them at once, which is where batching
pays, and each sequence's segment attends to its own buffer. It is registered with transformers' AttentionInterface
and receives the batch through the `kv_batch` forward argument; a forward without it (a plain
`model(ids)`) falls back to transformers' SDPA attention and masks, so the model stays usable as usual.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from specdec.decoding.tree_sampler import check_tree, depths
from specdec.engine.prefix_cache import FEATURES_SHARE, PrefixIndex, SequenceState

ATTENTION = "specdec_sequence_kv"


def kv_layout(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model's KV cache."""
    cfg = model.config
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, heads, head_dim


class SequenceKV(SequenceState):
    """One sequence's cache: per layer keys and values (kv_heads, capacity, head_dim); the first
    `length` positions are valid."""

    def __init__(self, devices: list[torch.device], kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 64, max_capacity: int | None = None):
        """devices[i]: where layer i runs (a model spread over GPUs keeps each layer's cache beside it)."""
        super().__init__()
        self.max_capacity = max_capacity  # doubling stops here (the model's context)
        self.keys = [torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device) for device in devices]
        self.values = [torch.empty_like(k) for k in self.keys]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not just the valid length)."""
        return 2 * sum(k.nbytes for k in self.keys)

    def reserve(self, positions: int) -> None:
        """Make room for `positions` positions, doubling so that growth is amortized O(1) per token."""
        if positions <= self.capacity:
            return
        doubled = 2 * self.capacity if self.max_capacity is None else min(2 * self.capacity, self.max_capacity)
        capacity = max(positions, doubled)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_empty(old.shape[0], capacity, old.shape[2])
                new[:, :self.length] = old[:, :self.length]
                buffers[i] = new


class BlockStore:
    """The dynamic executor's prefix cache: keyed blocks' keys and values copied out of the sequences
    that computed them, per layer (blocks, kv_heads, block_size, head_dim) beside the layer, within a
    budget of `blocks`; when full, the least recently used block is evicted. A new sequence whose prompt
    starts with keyed blocks gets a copy of them (`load`): one copy per layer, where its prefill would run
    the whole model over those tokens."""

    def __init__(self, index: PrefixIndex, blocks: int, devices: list[torch.device], kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        size = index.block_size
        # Reserved, not written: on CPU the pages become resident as blocks are first used.
        self.keys = [torch.empty(blocks, kv_heads, size, head_dim, dtype=dtype, device=device) for device in devices]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.index, self.blocks = index, blocks
        self.free = list(range(blocks - 1, -1, -1))
        self.used: OrderedDict[int, None] = OrderedDict()  # keyed blocks, least recently used first

    @property
    def nbytes(self) -> int:
        """Bytes the keyed blocks hold."""
        return len(self.used) * 2 * sum(k[0].nbytes for k in self.keys)

    def save(self, seq: "SequenceKV", first: int, parent: int, blocks: list[tuple[int, ...]]) -> list[int]:
        """Key seq's blocks first, first + 1, ... (blocks[i] their tokens; the first follows the prefix
        `parent`), copying in those the store does not hold yet: one copy per layer for all of them.
        Returns their serials; fewer when more new blocks come than the store holds (it keeps the first)."""
        serials, rows, taken = [], [], []
        for j, tokens in enumerate(blocks, first):
            found = self.index.find(parent, tokens)
            if found is not None:  # the store has it: used again
                block, serial = found
                self.used.move_to_end(block)
            else:
                # Blocks found come before blocks taken (a new block's serial is nobody's parent yet), so
                # while fewer than `blocks` are taken the least recently used is none of them.
                if len(taken) == self.blocks:
                    break
                block = self._take()
                serial = self.index.add(block, parent, tokens)
                rows.append(j)
                taken.append(block)
            serials.append(serial)
            parent = serial
        if taken:
            size, end = self.index.block_size, (rows[-1] + 1) * self.index.block_size
            rows_at, blocks_at = torch.tensor(rows), torch.tensor(taken)
            for store, buffers in ((self.keys, seq.keys), (self.values, seq.values)):
                for layer, buffer in zip(store, buffers):
                    # (kv_heads, positions, D) -> the rows' blocks (n, kv_heads, block_size, D)
                    picked = buffer[:, :end].unflatten(1, (-1, size)).index_select(1, rows_at.to(buffer.device))
                    layer.index_copy_(0, blocks_at.to(layer.device), picked.transpose(0, 1))
        return serials

    def _take(self) -> int:
        """A block to fill: a free one, or the least recently used one, evicted."""
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.used.popitem(last=False)
            self.index.remove(block)
        self.used[block] = None
        return block

    def forget(self) -> int:
        """A prefix-cache reset: every keyed block forgotten and free again; returns how many there were."""
        forgotten = self.index.clear()
        self.free += list(self.used)
        self.used.clear()
        return len(forgotten)

    def load(self, seq: "SequenceKV", blocks: list[int], first: int = 0) -> None:
        """seq gets these blocks' keys and values at its blocks first, first + 1, ..."""
        size = self.index.block_size
        start, end = first * size, (first + len(blocks)) * size
        seq.reserve(end)
        index = torch.tensor(blocks)
        for store, buffers in ((self.keys, seq.keys), (self.values, seq.values)):
            for layer, buffer in zip(store, buffers):
                # (n, kv_heads, block_size, D) -> (kv_heads, n * block_size, D)
                picked = layer.index_select(0, index.to(layer.device))
                buffer[:, start:end] = picked.transpose(0, 1).reshape(buffer.shape[0], end - start, -1)
        for block in blocks:
            self.used.move_to_end(block)


@dataclass
class KVBatch:
    """What one packed forward's attention needs: the forward's single row holds every sequence's new
    tokens back to back, seqs[i]'s `counts[i]` tokens starting at `starts[i]` (they follow its
    seqs[i].length cached ones); positions past the last segment are padding and attend to nothing."""

    seqs: list[SequenceKV]
    counts: list[int]
    trees: list[tuple[int, ...] | None] | None = None  # per sequence: its new tokens' parents (Step.tree)

    def __post_init__(self):
        # Every layer of the forward asks for the same masks (a sequence's length moves only after the
        # forward): built once per (sequence, window), not once per layer.
        self._masks: dict[tuple[int, int | None], torch.Tensor | None] = {}
        self.starts = []
        start = 0
        for seq, count in zip(self.seqs, self.counts):
            seq.reserve(seq.length + count)
            self.starts.append(start)
            start += count

    def visible(self, i: int, window: int | None, device) -> torch.Tensor | None:
        """seqs[i]'s attention mask in this forward (`_visible`), shared by every layer."""
        key = (i, window)
        if key not in self._masks:
            tree = self.trees[i] if self.trees else None
            length = self.seqs[i].length
            if tree is None:
                self._masks[key] = _visible(length, self.counts[i], window, device)
            else:
                mask = tree_mask(length, tree, device)
                if window:  # a node sees a key less than `window` positions before its own (by depth, not index)
                    nodes = length + torch.tensor(depths(tree), device=device)
                    keys = torch.cat([torch.arange(length, device=device), nodes])
                    mask &= (nodes[:, None] - keys[None, :]) < window
                self._masks[key] = mask
        return self._masks[key]


def _visible(length: int, count: int, window: int | None, device) -> torch.Tensor | None:
    """(count, length + count) bool: new token j (at position length + j) sees key i when i <= length + j
    (and i > length + j - window with a sliding window). None when every key is visible."""
    if count == 1 and not (window and length + 1 > window):
        return None
    mask = torch.ones(count, length + count, dtype=torch.bool, device=device).tril(length)
    if window:
        mask &= ~torch.ones_like(mask).tril(length - window)
    return mask


def tree_depths(tree: tuple[int, ...]) -> list[int]:
    """Each node's depth (0: it follows the cached tokens), for parents that come before their children
    (ValueError otherwise)."""
    check_tree(tree)
    return depths(tree)


def tree_mask(length: int, tree: tuple[int, ...], device) -> torch.Tensor:
    """(count, length + count) bool: node j sees every cached key and the keys of its ancestors and itself."""
    count = len(tree)
    mask = torch.zeros(count, length + count, dtype=torch.bool)
    mask[:, :length] = True
    for node, parent in enumerate(tree):
        mask[node, length + node] = True
        if parent >= 0:
            mask[node, length:] |= mask[parent, length:]
    return mask.to(device)


def sequence_kv_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                          dropout: float = 0.0, scaling: float | None = None, kv_batch: KVBatch | None = None,
                          sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, R, D); key, value (1, kv_heads, R, D): the packed new positions after rotary
    embedding. Returns (1, R, heads, D) like transformers' attention functions. s_aux (heads,): attention
    sinks (gpt-oss), a logit per head that every query's softmax also spreads its weight over."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit softcapping is not supported by the sequence KV cache")
    if kv_batch is None:
        if s_aux is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, sliding_window=sliding_window, **kwargs)
        # transformers' SDPA knows no sinks: the mask it built (bool, or none for a plain causal prompt)
        mask = attention_mask if attention_mask is not None else torch.ones(
            query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - query.shape[2])
        return attend(query, key, value, mask, scaling, s_aux).transpose(1, 2), None
    layer = module.layer_idx
    out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
    for i, (seq, start, count) in enumerate(zip(kv_batch.seqs, kv_batch.starts, kv_batch.counts)):
        new = slice(start, start + count)
        end = seq.length + count
        keys, values = seq.keys[layer], seq.values[layer]
        keys[:, seq.length:end] = key[0, :, new]
        values[:, seq.length:end] = value[0, :, new]
        attended = attend(query[:, :, new], keys[None, :, :end], values[None, :, :end],
                          kv_batch.visible(i, sliding_window, query.device), scaling, s_aux)
        out[0, new] = attended[0].transpose(0, 1)
    return out, None


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query (B, heads, R, D), keys and values (B, kv_heads, S, D), mask bool (.., R, S) True = seen (None:
    all) -> (B, heads, R, D). With sinks (heads,), each query's softmax runs over its keys and the head's sink
    logit, whose share is dropped (gpt-oss; transformers' eager attention): SDPA has no such term."""
    gqa = query.shape[1] != keys.shape[1]
    if sinks is None:
        return scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    combined = torch.cat([scores, sink], dim=-1)
    weights = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(weights.to(values.dtype), values)


def layer_devices(model, num_layers: int) -> list[torch.device]:
    """The device of each decoder layer's attention (its `layer_idx`), where that layer's KV buffers
    belong; layers without parameters of their own fall back to the model's device.

    With transformers' device_map="auto" a model's layers lie on several GPUs, and an attention reading a
    cache on another device would copy it across on every step (or fail)."""
    devices = [model.device] * num_layers
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and 0 <= index < num_layers:
            parameter = next(module.parameters(recurse=True), None)
            if parameter is not None:
                devices[index] = parameter.device
    return devices


def use_sequence_kv(model) -> None:
    """Route the model's attention through `sequence_kv_attention` (registered with transformers here, not
    at import: the static executor's processes never import transformers' modeling stack, llama_model.py)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, sequence_kv_attention)
    # Plain forwards (no kv_batch) get the masks transformers builds for SDPA (padding, sliding windows);
    # with a kv_batch the attention builds its own per row and ignores that one.
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


class ContiguousKV:
    """A KV store of one growable buffer per sequence and layer (`SequenceKV`), each beside its layer.

    Memory is not budgeted: buffers grow on demand as a forward writes (`KVBatch`), so `reserve` and
    `hold` have nothing to do and a sequence's release is just dropping it. With prefix caching
    (prefix_cache_tokens >= block_size) keyed blocks are copied into a `BlockStore` of that many tokens
    and out of it into new sequences."""

    def __init__(self, model, prefix_cache_tokens: int = 0, block_size: int = 32):
        layers, self.kv_heads, self.head_dim = kv_layout(model)
        self.block_size = block_size  # the prefix cache's unit (a sequence's buffers grow by the token)
        self.dtype = model.dtype
        self.layer_devices = layer_devices(model, layers)  # each layer's KV buffers live beside it
        self.max_capacity = getattr(model.config, "max_position_embeddings", None)
        self.prefix = PrefixIndex(block_size) if prefix_cache_tokens >= block_size else None
        self.store = BlockStore(self.prefix, prefix_cache_tokens // block_size, self.layer_devices, self.kv_heads,
                                self.head_dim, self.dtype) if self.prefix is not None else None
        if self.prefix is not None:  # a served head's features kept with the blocks (prefix_cache.py)
            block_bytes = 2 * sum(k[0].nbytes for k in self.store.keys)
            self.prefix.features_budget = int(FEATURES_SHARE * self.store.blocks * block_bytes)

    def new_sequence(self) -> SequenceKV:
        return SequenceKV(self.layer_devices, self.kv_heads, self.head_dim, self.dtype, max_capacity=self.max_capacity)

    def reserve(self, seq: SequenceKV, positions: int) -> None:
        """Room for `positions` tokens: the buffers grow when a forward writes them."""

    def hold(self, seq: SequenceKV, positions: int) -> None:
        """A new sequence's generation: memory is not budgeted, nothing to set aside."""

    def adopt(self, seq: SequenceKV, blocks: list[int], first: int) -> None:
        """seq's blocks first, first + 1, ... get the contents of these keyed blocks: copied from the store."""
        self.store.load(seq, blocks, first)

    def key_blocks(self, seq: SequenceKV, first: int, parent: int, blocks: list[tuple[int, ...]]) -> list[int]:
        """Key seq's blocks first, first + 1, ... (holding `blocks`' tokens; the first follows the prefix
        `parent`): copied into the store. Returns their serials (fewer if the store is full of them)."""
        return self.store.save(seq, first, parent, blocks)

    def rewrite_from(self, seq: SequenceKV, j: int) -> None:
        """seq writes into its blocks from j on next: they are its own buffers, nothing to do."""

    def move(self, seq: SequenceKV, source: list[int], target: list[int]) -> None:
        """The keys and values at positions `source` copied to positions `target` (an accepted tree path
        to where a chain would have put it), every layer: one indexed copy per buffer."""
        for buffers in (seq.keys, seq.values):
            for buffer in buffers:
                src = torch.tensor(source, device=buffer.device)
                buffer[:, torch.tensor(target, device=buffer.device)] = buffer[:, src]  # read, then write

    def release(self, seq: SequenceKV) -> None:
        """The buffers go with the sequence."""

    def reset_prefix_cache(self) -> int:
        """Every keyed block forgotten (sequences keep their own buffers); returns how many there were."""
        return self.store.forget() if self.store is not None else 0

    capacity_bytes = 0  # not budgeted: buffers grow on demand, as far as memory goes

    def bytes_held(self, sequences) -> int:
        """Bytes the sequences' KV buffers hold (their capacity, which grows by doubling)."""
        return sum(seq.nbytes for seq in sequences)

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes of keyed blocks kept for later prompts (the store's)."""
        return self.store.nbytes if self.store is not None else 0
