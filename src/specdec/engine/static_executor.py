"""The static-shape executor: a paged KV pool allocated once, and forwards of a few fixed shapes that
are captured once (CUDA graphs on the GPU) and replayed.

`CausalLM` (executor.py) runs transformers' own forward with Python deciding every shape; on a GPU the
host then spends longer launching kernels than the GPU spends running them. Here nothing in a decode
or verify forward changes shape from one step to the next:

- KV memory is one pool per layer, (blocks + 1, block_size, kv_heads, head_dim), allocated at load
  within a budget (`kv_pool_tokens`); a sequence holds a list of blocks, grown as it grows and returned
  when it ends. Rolling back rejected draft tokens is still just a smaller length. The extra block is
  scratch: padding rows write there and nobody reads it. A new sequence takes the blocks of its whole
  generation at its first step (`Step.reserve`, up to the context), so one that starts can finish; a
  step that needs blocks when too few are free fails with a CapacityError naming the budget (the
  sequence keeps what it had). With prefix caching, sequences whose prompts begin alike hold the same
  full blocks, and the blocks of ended prompts stay cached until the pool needs them (`prefix_cache.py`).
- A forward's inputs are tensors of a bucketed shape: (B sequences, T rows each) token ids and
  positions, where each row's key and value go (block, offset), each sequence's block table (B, W /
  block_size) and how many keys each row may see. Attention gathers a sequence's blocks into a window
  of W keys (W bucketed too) and masks by those counts, so lengths are data, not shapes.
- Each (B, T, W) bucket is captured once as a CUDA graph (`compile="graphs"`, the default on CUDA) and
  replayed: one launch per forward instead of hundreds. `compile="off"` runs the same forward eagerly
  (the reference the tests compare against). Forwards outside the buckets (prompts of more than T rows)
  run eagerly with their own shapes; more than B sequences run as several forwards.
- Inside the forward, the matrix products are the model's own weights (a layer's query/key/value
  projections fused into one product), and the pointwise work between them (norms, the residual adds,
  rotary embedding) goes through `kernels`: compiled by torch.compile into one kernel each where CUDA
  graphs run. The MLP runs as the model's module (its gate and up products and its activation), or
  with `fuse_mlp` as one gate/up product and one SiLU x up kernel (by default where CUDA graphs run). The
  whole forward is not compiled (README, "Measured design choices").

The forward is written here over the model's own modules (embeddings, norms, projections, rotary
embedding, MLP, head), so it serves the Llama family (Llama, SmolLM2, Mistral without a sliding
window, Qwen2/Qwen3); `supports` says whether a model qualifies, and `CausalLM` serves the rest.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

from specdec import tensor_names as tn
from specdec.engine import kernels
from specdec.engine.executor import CacheError, CapacityError, CausalLM
from specdec.engine.prefix_cache import PrefixIndex, SequenceState

COMPILE_MODES = tn.COMPILE_MODES
CAPTURE_RESERVE_BYTES = 2 << 30  # capturing at load stops when less is free: room for eager prompts
FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def supports(model) -> str | None:
    """None if the static forward can run `model`, else why not."""
    config = model.config
    if config.model_type not in FAMILY:
        return f"model type {config.model_type!r} is not one of {FAMILY}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return "a model spread over several devices"
    return None


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit`: the sizes a dimension is padded up to."""
    out = [1 << i for i in range(max(limit - 1, 0).bit_length()) if (1 << i) < limit]
    return out + [limit]


def bucket(value: int, sizes: list[int]) -> int | None:
    return next((size for size in sizes if size >= value), None)


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
    needs it: free blocks are handed out first, then cached ones, least recently released first."""

    def __init__(self, num_layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, index: PrefixIndex | None = None):
        shape = (blocks + 1, block_size, kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size, self.blocks, self.scratch = block_size, blocks, blocks
        self.free = list(range(blocks - 1, -1, -1))  # a stack: recently freed blocks are reused first
        self.zeroed = [False] * blocks
        self.index = index
        self.refs = [0] * blocks  # sequences holding each block
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered, held by none: oldest first
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
            block, _ = self.cached.popitem(last=False)
            self.index.remove(block)
            taken.append(block)
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


class Batch(NamedTuple):
    """The tensors of one forward, all (B, T) but `table` (B, W / block_size)."""

    ids: torch.Tensor
    positions: torch.Tensor
    write_block: torch.Tensor  # where each row's key and value go: block ...
    write_offset: torch.Tensor  # ... and position within it
    table: torch.Tensor  # each sequence's blocks, padded with the scratch block
    visible: torch.Tensor  # how many keys (from position 0) each row attends to

    @staticmethod
    def size(b: int, t: int, blocks: int) -> int:
        return 5 * b * t + b * blocks

    @classmethod
    def view(cls, flat, b: int, t: int, blocks: int) -> "Batch":
        """The fields as views of one flat int64 buffer (tensor or array) laid out field after field, so
        that a forward's inputs travel to the device in one copy."""
        bt = b * t
        rows = [flat[i * bt:(i + 1) * bt].reshape(b, t) for i in range(5)]
        table = flat[5 * bt:5 * bt + b * blocks].reshape(b, blocks)
        return cls(rows[0], rows[1], rows[2], rows[3], table, rows[4])

    def clear(self, scratch: int) -> None:
        """Padding values: id 0 at position 0, written to the scratch block, seeing one key."""
        for field, value in zip(self, (0, 0, scratch, 0, scratch, 1)):
            field[...] = value


class InputStaging:
    """Where a forward's integer inputs are assembled on the host before their one copy to the device.

    On CUDA the host buffers are pinned and used in turn: a copy from pinned memory is asynchronous, so
    the host prepares the next draft step while the GPU still runs this one (from pageable memory the
    copy waits for the stream first: a host sync per drafted token). A buffer is refilled only once its
    last copy has completed (an event per buffer). On CPU there is nothing to copy."""

    SLOTS = 4

    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers = [self._buffer(capacity) for _ in range(self.SLOTS if self.pinned else 1)]
        self.events: list = [None] * len(self.buffers)
        self.slot = 0

    def _buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.long, pin_memory=self.pinned)

    def host(self, size: int) -> np.ndarray:
        """A host buffer of `size` int64 values to fill (until the next `host` call)."""
        self.slot = (self.slot + 1) % len(self.buffers)
        if self.events[self.slot] is not None:
            self.events[self.slot].synchronize()
        if self.buffers[self.slot].numel() < size:
            self.buffers[self.slot] = self._buffer(max(size, 2 * self.buffers[self.slot].numel()))
        return self.buffers[self.slot].cpu().numpy()[:size]  # a host tensor: .cpu() is itself

    def send(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The last filled buffer on the device: copied into `out` (or a new tensor) on CUDA, the buffer
        itself on CPU."""
        source = self.buffers[self.slot][:size]
        if not self.pinned:
            return source
        out = torch.empty(size, dtype=torch.long, device=self.device) if out is None else out[:size]
        out.copy_(source, non_blocking=True)
        self.events[self.slot] = torch.cuda.Event()
        self.events[self.slot].record()
        return out


def fuse_linears(owner: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for the linears owner.<names> that read the same input (a layer's query, key
    and value projections): one matrix product instead of several. The modules' parameters become views
    of it, so the model is unchanged and no memory is added. None if they are not all plain linears
    alike (CPU's reordered oneDNN linears, mixed biases, a module without one of the names)."""
    fused = owner.__dict__.get("_fused_" + "_".join(names))
    if fused is not None:  # a second executor over the same model
        return fused
    linears = [getattr(owner, name, None) for name in names]
    if any(type(m) is not torch.nn.Linear for m in linears) or len({m.bias is None for m in linears}) > 1:
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        sizes = [m.out_features for m in linears]
        for m, part in zip(linears, weight.split(sizes)):
            m.weight = torch.nn.Parameter(part, requires_grad=False)
        if bias is not None:
            for m, part in zip(linears, bias.split(sizes)):
                m.bias = torch.nn.Parameter(part, requires_grad=False)
    owner.__dict__["_fused_" + "_".join(names)] = (weight, bias)  # a plain attribute, not a parameter
    return weight, bias


class LlamaForward:
    """The forward over a Llama-family model's weights, reading and writing the pool. Shapes in, logits
    (B, T, V) out; every shape is fixed by the inputs' shapes (graph-capturable). The pointwise work
    runs through `kernels` (compiled into one kernel each on CUDA, see kernels.py); each layer's
    query/key/value projections are one matrix product. The MLP is the model's own module, or with
    `fuse_mlp` (a SiLU MLP) its gate and up projections as one product and `kernels.silu_mul`."""

    def __init__(self, model, pool: BlockPool, fuse_mlp: bool = False):
        self.model, self.pool = model, pool
        self.kernels = kernels.EAGER  # StaticCausalLM.fuse swaps in the compiled ones
        self.body = model.model
        attn = self.body.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.workspace: list[torch.Tensor] | None = None
        self.qkv = [fuse_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.body.layers]
        # transformers names the activation in the config (its module, SiLUActivation, is not nn.SiLU).
        silu = getattr(model.config, "hidden_act", None) in ("silu", "swish")
        self.gate_up = [fuse_linears(layer.mlp, ("gate_proj", "up_proj")) if fuse_mlp and silu else None
                        for layer in self.body.layers]

    def reserve_workspace(self, blocks: int) -> None:
        """Gather windows of up to `blocks` blocks into two buffers allocated once and shared by every
        layer and every captured graph. Gathering into fresh tensors instead, each graph would keep its
        own (measured on an H100: 3.6 GiB for one 4-layer graph of 16 sequences x 8192 keys)."""
        shape = (blocks, *self.pool.keys[0].shape[1:])
        self.workspace = [torch.empty(shape, dtype=self.pool.keys[0].dtype, device=self.pool.keys[0].device)
                          for _ in range(2)]

    def _gather(self, buffer: torch.Tensor, table: torch.Tensor, which: int) -> torch.Tensor:
        """buffer[table] (table (B, NB) -> (B * NB, block_size, kv_heads, D)), into the workspace if any."""
        if self.workspace is None or table.numel() > self.workspace[which].shape[0]:
            return buffer[table]
        out = self.workspace[which][:table.numel()]
        return torch.index_select(buffer, 0, table.reshape(-1), out=out)

    def _qkv(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """x (N, H) -> (N, (heads + 2 kv_heads) D): queries, keys and values side by side."""
        if self.qkv[index] is not None:
            weight, bias = self.qkv[index]
            return torch.nn.functional.linear(x, weight, bias)
        attn = self.body.layers[index].self_attn
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)

    def _mlp(self, index: int, x: torch.Tensor) -> torch.Tensor:
        mlp = self.body.layers[index].mlp
        if self.gate_up[index] is None:
            return mlp(x)
        weight, bias = self.gate_up[index]
        return mlp.down_proj(self.kernels.silu_mul(torch.nn.functional.linear(x, weight, bias)))

    def __call__(self, batch: Batch, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V); with head_rows (R,) indices into the B * T rows, only theirs: (R, V) (a prompt
        wants one or K + 1 rows of logits, not one per token)."""
        body, pool, fn = self.body, self.pool, self.kernels
        b, t = batch.ids.shape
        n = b * t
        hidden = body.embed_tokens(batch.ids).reshape(n, -1)  # (N, H): the residual stream
        cos, sin = body.rotary_emb(hidden, batch.positions.reshape(1, n))  # (1, N, D)
        cos, sin = cos.reshape(n, -1), sin.reshape(n, -1)
        window = batch.table.shape[1] * pool.block_size
        # (B, T, W): row t of sequence b sees keys [0, visible[b, t])
        mask = torch.arange(window, device=hidden.device) < batch.visible[..., None]
        kv_heads = pool.keys[0].shape[2]
        groups = body.config.num_attention_heads // kv_heads
        # Grouped-query attention without repeating keys: a KV head's query heads are stacked along
        # the row axis, (B, kv_heads, groups * T, D), so one plain attention call serves them all.
        mask = mask[:, None, None].expand(b, 1, groups, t, window).reshape(b, 1, groups * t, window)
        layers = body.layers
        norm = layers[0].input_layernorm
        x = fn.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        heads = body.config.num_attention_heads
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            qkv = self._qkv(index, x)
            v = qkv[:, (heads + kv_heads) * self.head_dim:]
            if hasattr(attn, "q_norm"):  # Qwen3 normalizes queries and keys per head
                q, k = fn.rotate_qk(qkv, cos, sin, heads, kv_heads, attn.q_norm.weight, attn.k_norm.weight,
                                    attn.q_norm.variance_epsilon)
            else:
                q, k = fn.rotate_qk(qkv, cos, sin, heads, kv_heads)
            keys, values = pool.keys[index], pool.values[index]
            keys[batch.write_block, batch.write_offset] = k.view(b, t, kv_heads, self.head_dim)
            values[batch.write_block, batch.write_offset] = v.view(b, t, kv_heads, self.head_dim)
            seen_k = self._gather(keys, batch.table, 0).view(b, window, kv_heads, self.head_dim).transpose(1, 2)
            seen_v = self._gather(values, batch.table, 1).view(b, window, kv_heads, self.head_dim).transpose(1, 2)
            q = q.view(b, t, -1, self.head_dim).transpose(1, 2).reshape(b, kv_heads, groups * t, self.head_dim)
            out = scaled_dot_product_attention(q, seen_k, seen_v, attn_mask=mask, scale=self.scaling)
            out = out.reshape(b, -1, t, self.head_dim).transpose(1, 2).reshape(n, -1)
            post = layer.post_attention_layernorm
            hidden, x = fn.add_rms_norm(hidden, attn.o_proj(out), post.weight, post.variance_epsilon)
            # The residual add ends in the next layer's input norm, or the final one.
            following = layers[index + 1].input_layernorm if index + 1 < len(layers) else body.norm
            hidden, x = fn.add_rms_norm(hidden, self._mlp(index, x), following.weight, following.variance_epsilon)
        if head_rows is not None:
            return self.model.lm_head(x.index_select(0, head_rows))
        return self.model.lm_head(x).view(b, t, -1)


class CapturedForward:
    """One bucket's forward as a CUDA graph: static input tensors, the graph and its output. `run` copies
    a batch in, replays, and returns the output (valid until the next run)."""

    def __init__(self, forward: Callable[..., torch.Tensor], shape: tuple[int, int, int], pool: BlockPool,
                 device: torch.device, graph_pool, stream: torch.cuda.Stream, head_rows: int = 0):
        b, t, blocks = shape
        # The static inputs, and room after them for the indices of the rows wanted (at most b * t). With
        # head_rows (a prompt's bucket) the head runs on the first head_rows of those indices only: the
        # output is (head_rows, V), not one row of logits per token.
        size = Batch.size(b, t, blocks)
        self.flat = torch.zeros(size + b * t, dtype=torch.long, device=device)
        self.inputs = Batch.view(self.flat, b, t, blocks)
        self.inputs.clear(pool.scratch)
        if head_rows:
            head = self.flat[size:size + head_rows]
            forward = functools.partial(forward, head_rows=head)
        # Warm up on a side stream (lazy initialization must not be captured), then capture. The static
        # inputs point every write at the scratch block: capturing touches no sequence. One side stream
        # for every bucket: the allocator caches freed memory per stream (and cuBLAS a workspace per
        # stream), so a stream per bucket would keep one forward's worth of memory per bucket.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward(self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=graph_pool):
            self.output = forward(self.inputs)

    def run(self) -> torch.Tensor:
        """Replay over what `flat` holds now; the output is valid until the next run."""
        self.graph.replay()
        return self.output


class StaticCausalLM(CausalLM):
    """`CausalLM` over the paged pool and captured forwards (same calls, same results)."""

    def __init__(self, model, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, kv_pool_tokens: int = 0, block_size: int = 32,
                 max_context: int = 8192, max_batch: int = 8, max_rows: int = 17, compile: str = "auto",
                 kv_memory_fraction: float = 0.4, min_window: int = 128, fuse_kernels: bool | None = None,
                 fuse_mlp: bool | None = None, prefix_caching: bool = True, prefill_rows: int = 0,
                 log: Callable[[str], None] = lambda message: None):
        """kv_pool_tokens: the pool's size in tokens; 0 derives it from max_sequences * max_context,
        capped at kv_memory_fraction of the device's free memory (host memory on CPU).
        max_batch / max_rows: the largest bucket of sequences per forward and rows per sequence
        (verify forwards are K + 1 rows); min_window: the smallest bucket of keys attended over;
        fuse_kernels: the pointwise work compiled into fused kernels (kernels.py); None: with CUDA graphs.
        fuse_mlp: a SiLU MLP's gate and up projections as one product; None: where CUDA graphs run
        (`executor_bench.py --modes graphs,graphs-mlp` compares, README "The static executor").
        prefix_caching: a new sequence reuses the pool's blocks that hold its prompt's first tokens
        (`prefix_cache.py`); their keys and values are those its own prefill would write.
        prefill_rows: prompts of up to this many rows (beyond max_rows) run alone in buckets of their own,
        powers of two, padded, their head on the rows wanted only: captured like the others where graphs
        run (an eager prompt pays a launch per kernel); 0: every longer prompt runs eagerly."""
        problem = supports(model)
        if problem:
            raise ValueError(f"the static executor cannot run this model: {problem}")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        super().__init__(model, max_sequences=max_sequences, idle_timeout_s=idle_timeout_s, clock=clock)
        self.log = log
        device = self.device
        self.mode = ("graphs" if device.type == "cuda" else "off") if compile == "auto" else compile
        if self.mode == "graphs" and device.type != "cuda":
            raise ValueError("compile=graphs needs a CUDA device")
        max_context = min(max_context, getattr(model.config, "max_position_embeddings", max_context) or max_context)
        self.max_context = max_context
        heads, head_dim = self._kv_heads_and_dim()
        if not kv_pool_tokens:
            kv_pool_tokens = min(max_sequences * max_context,
                                 int(kv_memory_fraction * _free_memory(device)) // self.kv_bytes_per_token)
        blocks = kv_pool_tokens // block_size
        if blocks * block_size < max_context:
            raise ValueError(
                f"the KV pool ({kv_pool_tokens} tokens, {kv_pool_tokens * self.kv_bytes_per_token / 2**20:.0f} MiB) "
                f"cannot hold one sequence of max_context={max_context} tokens: raise kv_pool_tokens or the memory")
        # The pool holds the cached prefixes (in its blocks no sequence needs): no store of their own.
        self.prefix = PrefixIndex(block_size) if prefix_caching else None
        self.pool = BlockPool(self._num_layers, blocks, block_size, heads, head_dim, model.dtype, device, self.prefix)
        self.log(f"KV pool: {blocks} blocks of {block_size} tokens ({blocks * block_size} tokens, "
                 f"{blocks * self.pool.block_bytes / 2**30:.2f} GiB) on {device}")
        self.forward = LlamaForward(model, self.pool, self.mode == "graphs" if fuse_mlp is None else fuse_mlp)
        if fuse_kernels or (fuse_kernels is None and self.mode == "graphs"):
            self.fuse()
        self.batch_sizes = buckets(max_batch)
        self.row_sizes = buckets(max_rows)
        # A prompt's buckets (one sequence): powers of two above the row buckets, then prefill_rows.
        self.prefill_sizes = [size for size in buckets(prefill_rows) if size > max_rows] if prefill_rows > max_rows else []
        self.head_rows = max_rows  # the logits a prompt's bucket returns (its first call's K + 1 at most)
        # Windows of keys: min_window tokens doubling up to the context (in blocks).
        smallest = max(1, min_window // block_size)
        top = -(-max_context // block_size)
        self.window_sizes = sorted({min(smallest << i, top) for i in range(max(top // smallest, 1).bit_length() + 1)})
        self.captured: dict[tuple[int, int, int], CapturedForward] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.mode == "graphs" else None
        self._uncapturable: set[tuple[int, int, int]] = set()
        self._capture_stream = torch.cuda.Stream(device) if self.mode == "graphs" else None
        self.staging = InputStaging(device)
        if self.mode == "graphs":
            self.forward.reserve_workspace(self.batch_sizes[-1] * self.window_sizes[-1])

    def fuse(self) -> None:
        """Run the pointwise work through compiled kernels, compiled now: forwards of 1 and of 3 rows,
        under no_grad (what captures run in) and inference_mode (eager prompts), every write going to the
        scratch block, so that nothing compiles later, while a CUDA graph is captured. If compiling
        fails (no inductor backend for the device, no compiler) the eager kernels stay, logged: slower,
        same results."""
        started, (compiled, loaded) = time.perf_counter(), kernels.cache_counts()
        self.forward.kernels = kernels.compiled()
        try:
            for mode in (torch.no_grad, torch.inference_mode):
                for rows in (1, 3):
                    with mode():
                        flat = torch.zeros(Batch.size(1, rows, 1), dtype=torch.long, device=self.device)
                        batch = Batch.view(flat, 1, rows, 1)
                        batch.clear(self.pool.scratch)
                        self.forward(batch)
        except Exception as error:  # noqa: BLE001: any compiler failure leaves the eager path, which works
            self.forward.kernels = kernels.EAGER
            self.log(f"fused kernels: torch.compile failed ({type(error).__name__}: {error}); eager kernels")
            return
        compiled, loaded = (now - before for now, before in zip(kernels.cache_counts(), (compiled, loaded)))
        self.log(f"fused kernels: ready in {time.perf_counter() - started:.1f} s ({compiled} compiled, {loaded} "
                 f"loaded; inductor's cache {kernels.cache_location()})")

    # ---- sequences in the pool --------------------------------------------------------------------
    def _new_sequence(self) -> PagedSequence:
        return PagedSequence()

    def _reserve(self, seq: PagedSequence, positions: int) -> None:
        if positions > self.max_context:
            raise CacheError(f"{positions} tokens exceed the context of {self.max_context}")
        self.pool.grow(seq, positions)

    def _hold(self, seq: PagedSequence, positions: int) -> None:
        # A generation longer than the context fails when it gets there, not at its start.
        self.pool.grow(seq, min(positions, self.max_context))

    def _adopt(self, seq: PagedSequence, blocks: list[int], first: int) -> None:
        self.pool.share(seq, blocks, first)  # no copy: the blocks are held by one more sequence

    def _key_blocks(self, seq: PagedSequence, first: int, parent: int, blocks: list[tuple[int, ...]]) -> list[int]:
        serials = []
        for j, tokens in enumerate(blocks, first):  # no copy: the pool's block itself is keyed
            parent = self.prefix.add(seq.blocks[j], parent, tokens)
            serials.append(parent)
        return serials

    def _rewrite_from(self, seq: PagedSequence, j: int) -> None:
        # Shared or keyed blocks are never written: the sequence takes a copy, or the index lets go.
        for index in range(j, len(seq.chain)):
            self.pool.make_private(seq, index)

    def release(self, seq_id: int) -> bool:
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            self.pool.release(seq)
        return seq is not None

    def evict_idle(self) -> list[int]:
        deadline = self.clock() - self.idle_timeout_s
        stale = [sid for sid, seq in self.sequences.items() if seq.last_used < deadline]
        for sid in stale:
            self.release(sid)
        return stale

    @property
    def prefix_cache_bytes(self) -> int:
        return len(self.pool.cached) * self.pool.block_bytes

    @property
    def kv_bytes_allocated(self) -> int:
        """Bytes of the pool's blocks that sequences hold (cached prefixes that none holds are not counted:
        they make room whenever it is needed)."""
        return self.pool.held * self.pool.block_bytes

    # ---- forwards ---------------------------------------------------------------------------------
    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (sequences, rows, key blocks) bucket, in the order warm_up captures them: smallest windows
        first, then a prompt's buckets in the windows that can hold the prompt."""
        shapes = [(b, t, w) for w in self.window_sizes for b in self.batch_sizes for t in self.row_sizes]
        return shapes + [(1, t, w) for w in self.window_sizes for t in self.prefill_sizes
                         if w * self.pool.block_size >= t]

    def warm_up(self, time_budget_s: float = 120.0) -> tuple[int, float]:
        """Capture every bucket until the time budget is spent; the rest are captured on first use.
        Returns (buckets ready, seconds)."""
        started = time.perf_counter()
        if self.mode == "off":
            return 0, 0.0
        shapes = self.bucket_shapes()
        # This process's allocator, not the device's free memory (another model loading on the same GPU
        # at the same time would count too), without its cached free blocks (eager forwards leave some).
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        for shape in shapes:
            if time.perf_counter() - started > time_budget_s or self._captured(shape) is None:
                break
        torch.cuda.empty_cache()
        self.log(f"{len(self.captured)} CUDA graphs captured, taking "
                 f"{(torch.cuda.memory_reserved(self.device) - reserved_before) / 2**30:.2f} GiB of device memory")
        return len(self.captured), time.perf_counter() - started

    @torch.no_grad()
    def _captured(self, shape: tuple[int, int, int]) -> CapturedForward | None:
        """The bucket's graph, captured now if need be; None if the device has no memory left for it
        (that bucket, and larger ones, then run eagerly: slower, still correct)."""
        if shape in self.captured:
            return self.captured[shape]
        if shape in self._uncapturable:
            return None
        if torch.cuda.mem_get_info(self.device)[0] < CAPTURE_RESERVE_BYTES:
            if not self._uncapturable:
                self.log(f"less than {CAPTURE_RESERVE_BYTES >> 20} MiB free on {self.device}: no more CUDA graphs "
                         f"are captured (that much stays free for eager prompts); uncaptured buckets run eagerly")
            self._uncapturable.add(shape)
            return None
        try:
            forward = self.captured[shape] = CapturedForward(
                self.forward, shape, self.pool, self.device, self._graph_pool, self._capture_stream,
                head_rows=self.head_rows if shape[1] > self.row_sizes[-1] else 0)
        except torch.cuda.OutOfMemoryError:
            self._uncapturable.add(shape)
            torch.cuda.empty_cache()
            self.log(f"no GPU memory left to capture the bucket {shape} (sequences, rows, key blocks): it runs "
                     f"eagerly; lower kv_memory_fraction or kv_pool_tokens to leave room")
            return None
        return forward

    def _forward_rows(self, seqs: list[PagedSequence], rows: list, num_logits: list[int]) -> list[torch.Tensor]:
        """One forward per group of at most max_batch sequences whose new rows fit the row buckets; a
        longer one (a prompt) runs alone and eagerly. Same contract as `CausalLM._forward_rows`."""
        order = list(range(len(seqs)))
        long = [i for i in order if len(rows[i]) > self.row_sizes[-1]]
        short = [i for i in order if len(rows[i]) <= self.row_sizes[-1]]
        groups = [[i] for i in long] + [short[j:j + self.batch_sizes[-1]]
                                         for j in range(0, len(short), self.batch_sizes[-1])]
        results: list = [None] * len(seqs)
        for group in groups:
            logits = self._forward_group([seqs[i] for i in group], [rows[i] for i in group],
                                         [num_logits[i] for i in group])
            for i, out in zip(group, logits):
                results[i] = out
        return results

    def _forward_group(self, seqs: list[PagedSequence], rows: list, num_logits: list[int]) -> list[torch.Tensor]:
        counts = [len(row) for row in rows]
        block_size = self.pool.block_size
        batch = bucket(len(seqs), self.batch_sizes)
        width = bucket(max(counts), self.row_sizes)
        needed_blocks = max(-(-(seq.length + count) // block_size) for seq, count in zip(seqs, counts))
        window = bucket(needed_blocks, self.window_sizes)
        # A prompt (rows beyond the row buckets) in a prompt bucket of its own: the head on its wanted rows.
        prompt = width is None and len(seqs) == 1 and num_logits[0] <= self.head_rows
        if prompt:
            width = bucket(counts[0], self.prefill_sizes)
        bucketed = width is not None and batch is not None
        if not bucketed:  # a prompt: its own shape, eagerly
            batch, width = len(seqs), max(counts)
        # Every input, and the indices of the rows wanted, in one host buffer and one copy.
        wanted = [b * width + j for b, (count, n) in enumerate(zip(counts, num_logits)) for j in range(count - n, count)]
        head = len(wanted) if not (prompt and bucketed) else self.head_rows  # a bucket's: padded (row 0)
        wanted += [0] * (head - len(wanted))
        size = Batch.size(batch, width, window)
        flat = self.staging.host(size + len(wanted))
        host = Batch.view(flat, batch, width, window)
        host.clear(self.pool.scratch)
        on_device = []
        for b, (seq, row, count) in enumerate(zip(seqs, rows, counts)):
            where = seq.length + np.arange(count)
            if isinstance(row, torch.Tensor):
                on_device.append((b, row))
            else:
                host.ids[b, :count] = row
            host.positions[b, :count] = where
            host.positions[b, count:] = seq.length + count - 1  # padding rows: any valid position
            # The blocks this forward reaches (a sequence holds its whole reservation from its start).
            blocks = np.asarray(seq.blocks[:window], dtype=np.int64)
            host.write_block[b, :count] = blocks[where // block_size]
            host.write_offset[b, :count] = where % block_size
            host.table[b, :len(blocks)] = blocks
            host.visible[b, :count] = where + 1
        flat[size:] = wanted
        captured = self._captured((batch, width, window)) if bucketed and self.mode != "off" else None
        device_flat = self.staging.send(size + len(wanted), captured.flat if captured is not None else None)
        inputs = Batch.view(device_flat, batch, width, window)
        for b, row in on_device:  # drafted tokens stay on the device
            inputs.ids[b, :len(row)] = row
        if width > self.row_sizes[-1]:  # a prompt: the head on the wanted rows only, in their order
            out = captured.run() if captured is not None else self.forward(inputs, device_flat[size:size + len(wanted)])
            picked = out[:sum(num_logits)].clone()  # a captured output is overwritten by the next run
        else:
            out = captured.run() if captured is not None else self.forward(inputs)
            # The wanted rows, gathered into a new tensor (a captured output is overwritten by the next run).
            picked = out.reshape(batch * width, -1)[device_flat[size:size + len(wanted)]]
        for seq, count in zip(seqs, counts):
            seq.length += count
            self.tokens_processed += count
        return list(torch.split(picked, num_logits))


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:  # MemAvailable: what can be had without swapping
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024
