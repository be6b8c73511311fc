"""A Llama-family forward written over the model's own modules, reading and writing a paged KV pool
(`paged_kv.BlockPool`), in which no shape depends on the data: graph-capturable (`static_forward.py`).

The matrix products are the model's own weights (a layer's query/key/value projections fused into one
product), and the pointwise work between them (norms, the residual adds, rotary embedding) goes through
`kernels`: compiled by torch.compile into one kernel each where CUDA graphs run. The MLP runs as the
model's module (its gate and up products and its activation), or with `fuse_mlp` as one gate/up product
and one SiLU x up kernel. It serves the Llama family (Llama, SmolLM2, Mistral without a sliding window,
Qwen2/Qwen3); `supports` says whether a model qualifies (the eager transformers forward serves the rest).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention

from specdec import tensor_names as tn
from specdec.engine import fp8_linear, kernels, paged_attention, panel_linear
from specdec.engine.lora import AdapterSet

# MiMo's model_type: a Qwen2 model whose checkpoint also holds MTP layers (draft_heads serves them as a draft)
MIMO = "mimo"
FAMILY = ("llama", "mistral", "qwen2", "qwen3", MIMO)


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


class Batch(NamedTuple):
    """The tensors of one forward, all (B, T) but `table` (B, W / block_size)."""

    ids: torch.Tensor
    positions: torch.Tensor
    write_block: torch.Tensor  # where each row's key and value go: block ...
    write_offset: torch.Tensor  # ... and position within it
    table: torch.Tensor  # each sequence's blocks, padded with the scratch block
    visible: torch.Tensor  # how many keys (from position 0) each row attends to
    # A tree's rows (`Step.tree`) also see the keys of their ancestors among the sequence's new rows, which
    # sit at [visible, visible + T): bit j set where row j is one of them (or the row itself). 0: a chain.
    ancestors: torch.Tensor
    adapter: torch.Tensor  # each row's LoRA adapter (lora.AdapterSet's slot; 0: the base model)

    FIELDS = 7  # the (B, T) fields

    @staticmethod
    def size(b: int, t: int, blocks: int) -> int:
        return Batch.FIELDS * b * t + b * blocks

    @classmethod
    def view(cls, flat, b: int, t: int, blocks: int) -> "Batch":
        """The fields as views of one flat int64 buffer (tensor or array) laid out field after field, so
        that a forward's inputs travel to the device in one copy."""
        bt = b * t
        rows = [flat[i * bt:(i + 1) * bt].reshape(b, t) for i in range(cls.FIELDS)]
        table = flat[cls.FIELDS * bt:cls.FIELDS * bt + b * blocks].reshape(b, blocks)
        return cls(rows[0], rows[1], rows[2], rows[3], table, rows[4], rows[5], rows[6])

    def clear(self, scratch: int) -> None:
        """Padding values: id 0 at position 0, written to the scratch block, seeing one key, the base model."""
        for field, value in zip(self, (0, 0, scratch, 0, scratch, 1, 0, 0)):
            field[...] = value


MAX_TREE_ROWS = 64  # a tree's rows per sequence: its ancestors are the bits of one int64
CPU_KERNEL_ROWS = MAX_TREE_ROWS  # rows per sequence up to which the CPU's attention kernel runs (then SDPA)


def ancestor_bits(tree: tuple[int, ...]) -> list[int]:
    """Each node's ancestors among the tree's rows, itself included, as the bits of an int64 (bit 63 as
    the sign, which `Batch.ancestors` holds): tree[i] is node i's parent, -1 or an earlier node."""
    bits: list[int] = []
    for node, parent in enumerate(tree):
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << node))
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def attention_mask(batch: Batch, window: int) -> torch.Tensor:
    """(B, T, W) bool: row t of sequence b sees the keys before visible[b, t], and where it is a tree's
    row, the keys of its ancestors right after them (bit j of ancestors[b, t]: the key at visible + j)."""
    keys = torch.arange(window, device=batch.visible.device)
    visible = batch.visible[..., None]
    mask = keys < visible
    offset = keys - visible  # (B, T, W): a key's row in the tree, where it is one
    in_tree = (offset >= 0) & (offset < MAX_TREE_ROWS)
    bit = (batch.ancestors[..., None] >> offset.clamp(0, MAX_TREE_ROWS - 1)) & 1
    return mask | (in_tree & (bit == 1))


def fuse_linears(owner: torch.nn.Module, names: tuple[str, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | torch.nn.Module | None:
    """One weight (and bias) for the linears owner.<names> that read the same input (a layer's query, key
    and value projections): one matrix product instead of several. The modules' parameters become views
    of it, so the model is unchanged and no memory is added. FP8 linears alike: one fused Fp8Linear
    (fp8_linear.fuse); CPU panel linears one PanelLinear (panel_linear.fuse). None if they are not all
    plain linears, FP8 or panel ones alike (CPU's reordered oneDNN linears, mixed biases or encodings, a
    module without one of the names)."""
    linears = [getattr(owner, name, None) for name in names]
    kinds = {type(m) for m in linears}
    if kinds == {panel_linear.PanelLinear}:
        key = "_fused_" + "_".join(names) + "_panels"
        if key not in owner.__dict__:
            owner.__dict__[key] = panel_linear.fuse(linears)
        return owner.__dict__[key]
    if len(kinds) > 1 or not kinds <= {torch.nn.Linear, fp8_linear.Fp8Linear} \
            or len({m.bias is None for m in linears}) > 1:
        return None  # also where a copy of a fused model had its linears replaced since (oneDNN)
    fp8 = kinds == {fp8_linear.Fp8Linear}
    key = "_fused_" + "_".join(names) + ("_fp8" if fp8 else "")  # a copy quantized since has its own
    fused = owner.__dict__.get(key)
    if fused is not None:  # a second executor over the same model
        return fused
    if fp8:
        owner.__dict__[key] = fused = fp8_linear.fuse(linears)
        return fused
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        sizes = [m.out_features for m in linears]
        for m, part in zip(linears, weight.split(sizes)):
            m.weight = torch.nn.Parameter(part, requires_grad=False)
        if bias is not None:
            for m, part in zip(linears, bias.split(sizes)):
                m.bias = torch.nn.Parameter(part, requires_grad=False)
    owner.__dict__[key] = (weight, bias)  # a plain attribute, not a parameter
    return weight, bias


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x); a CPU panel linear's forward called directly: nn.Module's call machinery (hooks, none
    here) costs about as much as a 1-row product, and a step makes one call per projection
    (docs/results/2026-11-30-avx2-tiles.md)."""
    return module.forward(x) if module.__class__ is panel_linear.PanelLinear else module(x)


class LlamaForward:
    """The forward over a Llama-family model's weights, reading and writing the pool. Shapes in, logits
    (B, T, V) out; every shape is fixed by the inputs' shapes (graph-capturable). The pointwise work
    runs through `kernels` (compiled into one kernel each on CUDA, see kernels.py); each layer's
    query/key/value projections are one matrix product. The MLP is the model's own module, or with
    `fuse_mlp` (a SiLU MLP) its gate and up projections as one product and `kernels.silu_mul` (None: only
    where that is exact, CPU panel linears). On the CPU (float32) the pointwise work is `kernels.cpu()`.
    attention (tn.ATTENTION_KINDS): "paged", the Triton kernel reading the pool in place
    (`paged_attention.py`), or on the CPU csrc/cpu_layer.cpp's, reading it in place too; "sdpa", each
    sequence's window gathered and masked for torch's SDPA (any device and dtype); "auto", paged where
    a kernel serves the device, dtype and head size. adapters: LoRA adapters (lora.py), each row running
    the one `Batch.adapter` names."""

    def __init__(self, model, pool, fuse_mlp: bool | None = False, hidden_layers: tuple[int, ...] = (),
                 skip: tuple[int, ...] = (), attention: str = "auto", adapters: AdapterSet | None = None):
        self.model, self.pool = model, pool
        self.adapters = adapters if adapters else None
        self._lora = None  # a forward's lora.Plan: how its rows take their adapters (None: no row has one)
        self.hidden_layers = tuple(hidden_layers)  # a forward also returns the residual stream after these
        # A layer-skip self-draft (skip_layers.py): these decoder layers do not run (their pool slots stay
        # unwritten); the rest run in order, each writing its own layer's keys and values.
        self.run_layers = tuple(i for i in range(len(model.model.layers)) if i not in set(skip))
        # StaticForward.fuse swaps in compiled ones where CUDA graphs run
        self.cpu = kernels.cpu(pool.keys[0].device, pool.keys[0].dtype)
        self.kernels = self.cpu or kernels.EAGER
        # On the CPU, csrc/cpu_layer.cpp's attention (built with the kernels); the Triton kernel elsewhere
        self.cpu_attention = self.cpu is not None
        self.cpu_paged_attention = panel_linear.build().module.paged_attention if self.cpu_attention else None
        self.cpu_store_kv = panel_linear.build().module.store_kv if self.cpu_attention else None
        self.body = model.model
        attn = self.body.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.attention = self._attention(attention, pool.keys[0])
        self.workspace: list[torch.Tensor] | None = None
        self.qkv = [fuse_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.body.layers]
        # transformers names the activation in the config (its module, SiLUActivation, is not nn.SiLU).
        silu = getattr(model.config, "hidden_act", None) in ("silu", "swish")
        self.gate_up = [fuse_linears(layer.mlp, ("gate_proj", "up_proj")) if silu and (
            fuse_mlp or (fuse_mlp is None and isinstance(layer.mlp.gate_proj, panel_linear.PanelLinear))) else None
            for layer in self.body.layers]

    def _attention(self, wanted: str, keys: torch.Tensor) -> str:
        if wanted not in tn.ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {tn.ATTENTION_KINDS}, got {wanted!r}")
        if keys.device.type == "cpu":
            problem = None if self.cpu else f"the CPU attention kernel runs float32 models, not {keys.dtype}" \
                if keys.dtype != torch.float32 else f"the CPU kernels did not build: {panel_linear.build().problem}"
        else:
            problem = paged_attention.unavailable(keys.device, keys.dtype, self.head_dim)
        if wanted == "paged" and problem:
            raise ValueError(f"attention=paged: {problem}")
        if wanted == "auto":
            return "paged" if problem is None else "sdpa"
        return wanted

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

    def _adapted(self, index: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y, the base model's `group` product of x in layer `index`, plus what the rows' adapters add."""
        return y if self._lora is None else self.adapters.add(index, group, x, y, self._lora)

    def _qkv(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """x (N, H) -> (N, (heads + 2 kv_heads) D): queries, keys and values side by side."""
        if isinstance(self.qkv[index], (fp8_linear.Fp8Linear, panel_linear.PanelLinear)):
            qkv = _linear(self.qkv[index], x)
        elif self.qkv[index] is not None:
            weight, bias = self.qkv[index]
            qkv = torch.nn.functional.linear(x, weight, bias)
        else:
            attn = self.body.layers[index].self_attn
            qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        return self._adapted(index, "qkv", x, qkv)

    def _mlp(self, index: int, x: torch.Tensor) -> torch.Tensor:
        mlp = self.body.layers[index].mlp
        fused = self.gate_up[index]
        if fused is None and self._lora is None:
            return mlp(x)
        if fused is None:  # the model's MLP, its products one by one: an adapter adds to each
            gate_up = torch.cat([_linear(mlp.gate_proj, x), _linear(mlp.up_proj, x)], dim=-1)
            gate, up = self._adapted(index, "gate_up", x, gate_up).chunk(2, dim=-1)
            inner = mlp.act_fn(gate) * up
        else:
            gate_up = _linear(fused, x) if isinstance(fused, torch.nn.Module) else torch.nn.functional.linear(x, *fused)
            inner = self.kernels.silu_mul(self._adapted(index, "gate_up", x, gate_up))
        return self._adapted(index, "down", inner, _linear(mlp.down_proj, inner))

    def __call__(self, batch: Batch, head_rows: torch.Tensor | None = None):
        """Logits (B, T, V); with head_rows (R,) indices into the B * T rows, only theirs: (R, V) (a prompt
        wants one or K + 1 rows of logits, not one per token). With hidden_layers, (logits, hidden): the
        residual stream after each of those layers at every row, (B, T, L, H)."""
        body, pool, fn = self.body, self.pool, self.kernels
        b, t = batch.ids.shape
        n = b * t
        if self.adapters is not None:  # the rows' adapters, grouped once for every product of the forward
            self._lora = self.adapters.plan(batch.adapter.reshape(n))
        hidden = body.embed_tokens(batch.ids).reshape(n, -1)  # (N, H): the residual stream
        cos, sin = body.rotary_emb(hidden, batch.positions.reshape(1, n))  # (1, N, D)
        cos, sin = cos.reshape(n, -1), sin.reshape(n, -1)
        window = batch.table.shape[1] * pool.block_size
        kv_heads = pool.keys[0].shape[2]
        groups = body.config.num_attention_heads // kv_heads
        paged = self.attention == "paged"
        # On the CPU the kernel serves decode and verify forwards; a prompt's rows go to SDPA, whose blocked
        # products scale better with the rows (the kernel runs each row's keys on its own; measured in
        # docs/results/2026-11-30-cpu-layer-kernels.md)
        on_cpu = paged and self.cpu_attention and t <= CPU_KERNEL_ROWS
        triton = paged and not self.cpu_attention
        if triton:  # how far into its window each sequence's rows see (its cache and its new rows)
            limit = (batch.visible.amax(1) + t).clamp_(max=window)
        elif not on_cpu:
            mask = attention_mask(batch, window)  # (B, T, W)
            # Grouped-query attention without repeating keys: a KV head's query heads are stacked along
            # the row axis, (B, kv_heads, groups * T, D), so one plain attention call serves them all.
            mask = mask[:, None, None].expand(b, 1, groups, t, window).reshape(b, 1, groups * t, window)
        layers, run = body.layers, self.run_layers
        norm = layers[run[0]].input_layernorm
        x = fn.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        heads = body.config.num_attention_heads
        v_column = (heads + kv_heads) * self.head_dim  # where a row's values start in its qkv
        kept = []  # the output of each of hidden_layers
        for position, index in enumerate(run):
            layer = layers[index]
            attn = layer.self_attn
            qkv = self._qkv(index, x)
            if hasattr(attn, "q_norm"):  # Qwen3 normalizes queries and keys per head
                q, k = fn.rotate_qk(qkv, cos, sin, heads, kv_heads, attn.q_norm.weight, attn.k_norm.weight,
                                    attn.q_norm.variance_epsilon)
            else:
                q, k = fn.rotate_qk(qkv, cos, sin, heads, kv_heads)
            keys, values = pool.keys[index], pool.values[index]
            if self.cpu_store_kv is not None:  # one call, not two index_put
                self.cpu_store_kv(keys, values, k.reshape(n, kv_heads, self.head_dim).contiguous(), qkv, v_column,
                                  batch.write_block, batch.write_offset)
            else:
                keys[batch.write_block, batch.write_offset] = k.view(b, t, kv_heads, self.head_dim)
                values[batch.write_block, batch.write_offset] = qkv[:, v_column:].view(b, t, kv_heads,
                                                                                       self.head_dim)
            if on_cpu:
                out = self.cpu_paged_attention(q, keys, values, batch.table, batch.visible, batch.ancestors,
                                               self.scaling)
            elif triton:
                out = paged_attention.paged_attention(q.contiguous(), keys, values, batch.table, batch.visible,
                                                      batch.ancestors, limit, self.scaling).view(n, -1)
            else:
                seen_k = self._gather(keys, batch.table, 0).view(b, window, kv_heads, self.head_dim).transpose(1, 2)
                seen_v = self._gather(values, batch.table, 1).view(b, window, kv_heads, self.head_dim).transpose(1, 2)
                q = q.view(b, t, -1, self.head_dim).transpose(1, 2).reshape(b, kv_heads, groups * t, self.head_dim)
                out = scaled_dot_product_attention(q, seen_k, seen_v, attn_mask=mask, scale=self.scaling)
                out = out.reshape(b, -1, t, self.head_dim).transpose(1, 2).reshape(n, -1)
            post = layer.post_attention_layernorm
            hidden, x = fn.add_rms_norm(hidden, self._adapted(index, "o", out, _linear(attn.o_proj, out)), post.weight,
                                        post.variance_epsilon)
            # The residual add ends in the next layer's input norm, or the final one.
            following = layers[run[position + 1]].input_layernorm if position + 1 < len(run) else body.norm
            hidden, x = fn.add_rms_norm(hidden, self._mlp(index, x), following.weight, following.variance_epsilon)
            if index in self.hidden_layers:  # transformers' hidden_states: the last layer's after the final norm
                kept.append(x if index + 1 == len(layers) else hidden)
        if head_rows is not None:
            logits = _linear(self.model.lm_head, x.index_select(0, head_rows))
        else:
            logits = _linear(self.model.lm_head, x).view(b, t, -1)
        if not self.hidden_layers:
            return logits
        ranked = sorted(set(self.hidden_layers))  # `kept` is in the layers' order
        stacked = torch.stack([kept[ranked.index(layer)] for layer in self.hidden_layers], dim=1)  # (N, L, H)
        return logits, stacked.view(b, t, *stacked.shape[1:])
