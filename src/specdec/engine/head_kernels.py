"""An EAGLE head's step (or an MTP layer's) on the CPU's layer kernels (csrc/cpu_layer.cpp), for drafting.

Eagerly, `EagleHead.step` is transformers' norms and rotary embedding, SDPA over a masked window and a
scatter of the draft vocabulary's logits into the target's: about sixty small torch operations around
nine matrix products, ~40 % of a one-row step on the 2-core CPU (docs/results/2026-11-30-cpu-head-kernels.md).
Here each is one call of the kernels the static executor's target runs (`kernels.cpu()`): the norms, the
rotary embedding of the fused query/key/value product, attention over the head's cache read in place,
SiLU(gate) x up; the rotary table is made once. The math is the head's own (the same functions as
`kernels.EAGER`); the logits equal `EagleHead.step`'s up to float32 rounding (unit test).

Which keys a row attends to is said as the CPU attention kernel reads it (llama_forward.Batch): the
first `before[r]` entries of the cache and, bit j of `ancestors[r]` set, entry before[r] + j — a chain's
row sees the entries up to itself, a tree's node the sequence's entries, its ancestors and itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from specdec.decoding.sampling import greedy
from specdec.engine import kernels, panel_linear
from specdec.engine.draft_heads import EAGLE3, MTP, EagleHead, HeadCache, scatter_logits
from specdec.engine.llama_forward import fuse_linears

ANCESTOR_BITS = 64  # a row's entries past `before` it can see: the bits of one int64


class DraftLogits(NamedTuple):
    """An EAGLE-3 head's logits over its draft vocabulary, draft (..., Vd), not scattered into the target's:
    `ids` (Vd,) the target id of each column, ascending (the target-vocabulary logits are -inf elsewhere),
    `index` (V,) each target id's column or -1. A greedy draft picks its token here (the same first maximum:
    the ids ascend) without writing and reading a row of the whole vocabulary."""

    draft: torch.Tensor
    ids: torch.Tensor
    index: torch.Tensor

    def __getitem__(self, row) -> DraftLogits:
        return DraftLogits(self.draft[row], self.ids, self.index)

    def full(self) -> torch.Tensor:
        """The logits over the target's vocabulary (..., V), as EagleHead.step returns them."""
        return scatter_logits(self.draft, self.ids, len(self.index))

    def greedy(self) -> torch.Tensor:
        """The greedy token (a target id) of each row: (...,) int64."""
        return self.ids[greedy(self.draft)]

    def probability(self, token: torch.Tensor) -> torch.Tensor:
        """softmax(logits)[token] over the target's vocabulary (sampling.token_probability): () float32."""
        column = self.index[token.reshape(1)]
        if int(column) < 0:
            return torch.zeros((), dtype=torch.float32)
        return torch.softmax(self.draft.float(), dim=-1).gather(-1, column).reshape(())


class HeadKernels:
    """`step(tokens, hidden, positions, cache, first, before, ancestors)`: EagleHead.step over the CPU
    kernels, the rows' keys and values written at cache entries first.. (inference only)."""

    def __init__(self, head: EagleHead, kernel_set: kernels.Kernels):
        self.head, self.fn = head, kernel_set
        self.attention = panel_linear.build().module.paged_attention
        config = head.config
        self.eagle3, self.mtp = config.kind == EAGLE3, config.kind == MTP
        self.layers = head.decoder_layers()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scaling = self.head_dim ** -0.5  # SDPA's default, as the head's module uses
        self.eps = config.rms_norm_eps
        self.qkv = [fuse_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers]
        self.gate_up = [fuse_linears(layer.mlp, ("gate_proj", "up_proj")) for layer in self.layers]
        self.cos = self.sin = torch.empty(0)
        self.table = torch.zeros(1, 1, dtype=torch.long)  # the cache is one block of the pool the kernel reads
        self.ids = self.index = None  # DraftLogits' (an EAGLE-3 head's reduced vocabulary, its ids ascending)
        if self.eagle3 and head.lm_head.out_features < config.vocab_size:
            ids = head.draft_target_ids()
            if bool((ids[1:] > ids[:-1]).all()):
                self.ids = ids.clone()
                self.index = torch.full((config.vocab_size,), -1, dtype=torch.long)
                self.index[ids] = torch.arange(len(ids))

    @classmethod
    def serving(cls, head) -> HeadKernels | None:
        """The kernels for this head where they serve it (an EAGLE head, float32 on a CPU, the kernels
        built); None elsewhere (GPUs replay CUDA graphs of the module's step instead)."""
        if not isinstance(head, EagleHead):
            return None
        parameter = next(head.parameters())  # its norms' weights (the linears may be packed into buffers)
        fns = kernels.cpu(parameter.device, parameter.dtype)
        return None if fns is None else cls(head, fns)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (m, D) of the positions, from a table made by the head's own rotary module (grown by
        doubling): each entry is the same product of a frequency and a position as one made alone. A
        dynamic rotary embedding (its frequencies depend on the longest position seen) asks the module."""
        if "dynamic" in self.head.rotary.rope_type:
            cos, sin = self.head.rotary(torch.zeros(1, dtype=torch.float32), positions[None])
            return cos[0], sin[0]
        end = int(positions.max()) + 1
        if end > self.cos.shape[0]:
            size = max(256, 1 << (end - 1).bit_length())
            reference = torch.zeros(1, dtype=torch.float32)
            cos, sin = self.head.rotary(reference, torch.arange(size)[None])
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    @staticmethod
    def _linear(fused, modules: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
        """The outputs of `modules` side by side: one product where they were fused (fuse_linears)."""
        if isinstance(fused, nn.Module):
            return fused(x)
        if fused is not None:
            return nn.functional.linear(x, *fused)
        return torch.cat([module(x) for module in modules], dim=-1)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
             first: int, before: torch.Tensor, ancestors: torch.Tensor, reduced: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | DraftLogits]:
        """tokens (m,), hidden (m, h), positions (m,); before, ancestors (m,) int64 -> (the next hidden
        (m, h), logits over the target's vocabulary (m, V)), as EagleHead.step. With `reduced`, an EAGLE-3
        head's logits as DraftLogits where its draft vocabulary is smaller (and its ids ascend)."""
        return self.step_many(tokens, hidden, positions, [(tokens.shape[0], cache, first, before, ancestors)],
                              reduced)

    def step_many(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  caches: list[tuple[int, HeadCache, int, torch.Tensor, torch.Tensor]], reduced: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | DraftLogits]:
        """`step` over the rows of several sequences at once: tokens (M,), hidden (M, h), positions (M,), the
        rows of sequence i the next rows[i] of them, given as caches[i] = (rows, its cache, first, before
        (rows,), ancestors (rows,)). Every product runs once over the M rows (a batch of sequences reads the
        head's weights once, not once each); each sequence's rows attend over its own cache."""
        head, fn, eps = self.head, self.fn, self.eps
        m = tokens.shape[0]
        embeds = nn.functional.embedding(tokens, head.embed)
        first = self.layers[0]
        if self.eagle3:
            normed = fn.rms_norm(hidden.contiguous(), first.hidden_norm.weight, eps)
            x = torch.cat([fn.rms_norm(embeds, first.input_layernorm.weight, eps), normed], dim=-1)
            residual = head.residual(hidden, normed)
        elif self.mtp:  # (EagleHead._mtp_step: `hidden` is hidden_layernorm's already; a plain layer follows)
            embeds = embeds * (positions != 0).to(embeds.dtype)[:, None]
            residual = head.input_proj(torch.cat([hidden, fn.rms_norm(embeds, head.token_layernorm.weight, eps)], -1))
            x = fn.rms_norm(residual, first.input_layernorm.weight, eps)
        else:
            x = residual = head.fc(torch.cat([embeds, hidden], dim=-1))
        cos, sin = self._rotary(positions)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            qkv = self._linear(self.qkv[index], (attn.q_proj, attn.k_proj, attn.v_proj), x)
            if hasattr(attn, "q_norm"):  # a Qwen3 layer's per-head norms of the queries and keys
                q, k = fn.rotate_qk(qkv, cos, sin, self.heads, self.kv_heads, attn.q_norm.weight, attn.k_norm.weight,
                                    eps)
            else:
                q, k = fn.rotate_qk(qkv, cos, sin, self.heads, self.kv_heads)
            v = qkv[:, (self.heads + self.kv_heads) * self.head_dim:].reshape(m, self.kv_heads, self.head_dim)
            outs, row = [], 0
            for rows, cache, start, before, ancestors in caches:
                end = row + rows
                cache.write(start, k[row:end], v[row:end], index)
                outs.append(self.attention(q[row:end], cache.keys[index][None], cache.values[index][None], self.table,
                                           before[None], ancestors[None], self.scaling))
                row = end
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            post = layer.post_attention_layernorm
            x, normed = fn.add_rms_norm(residual.contiguous(), attn.o_proj(out), post.weight, eps)
            mlp = layer.mlp
            gate_up = self._linear(self.gate_up[index], (mlp.gate_proj, mlp.up_proj), normed)
            update = mlp.down_proj(fn.silu_mul(gate_up))
            if index + 1 < len(self.layers):  # the next (plain) layer's input: its norm of this one's output
                residual, x = fn.add_rms_norm(x, update, self.layers[index + 1].input_layernorm.weight, eps)
        if self.mtp:
            _, state = fn.add_rms_norm(x, update, head.final_layernorm.weight, eps)
            return fn.rms_norm(state, head.hidden_layernorm.weight, eps), nn.functional.linear(state, head.target_head)
        if not self.eagle3:
            out = x + update
            return out, nn.functional.linear(out, head.target_head)
        out, normed = fn.add_rms_norm(x, update, head.norm.weight, eps)
        draft_logits = head.lm_head(normed)
        if draft_logits.shape[-1] == head.config.vocab_size:
            return out, draft_logits
        if reduced and self.ids is not None:
            return out, DraftLogits(draft_logits, self.ids, self.index)
        return out, scatter_logits(draft_logits, head.draft_target_ids(), head.config.vocab_size)
