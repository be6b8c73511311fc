"""Trained draft heads (EAGLE-1, EAGLE-3, Medusa, MLP speculators) in the layouts their authors publish, read and
written.

A head drafts from the target's own features (hidden states) rather than from tokens alone:

  EAGLE-1  entry i: fc(embed(token i+1) ‖ f_i) -> one decoder layer without input norm -> feature;
           logits = the target's lm_head(feature). f_i is the target's last hidden state after its final
           norm, later the head's own output feature.
  EAGLE-3  entry i: input_layernorm(embed(token i+1)) ‖ hidden_norm(g_i) -> attention over 2h -> MLP
           (-> further plain decoder layers, where a head has them) -> g_{i+1} (pre-norm); logits =
           lm_head(norm(g)) over a reduced draft vocabulary (target id = draft id + d2t[draft id]).
           g_i = fc(the target's states entering three of its layers) for the target's positions, the
           head's own pre-norm output after that.
  Medusa   head j: [x + SiLU(Linear(x))] * L then Linear(h, V): token t+j+2 from the target's post-norm
           last hidden state at t (no cache, no recurrence).
  MLP      IBM's speculator (vLLM's `mlp_speculator`): stage j: s_{j+1} = GELU(norm_j(proj_j(s_j) + w emb_j(x_j)))
           and logits head_j(s_{j+1}) of token x_{j+1}; s_0 the target's post-norm last hidden state at t, x_0
           token t+1 (no cache: a recurrence over its own drafted tokens).
  MTP      a model's own multi-token-prediction layer (MiMo's `model.mtp_layers.0.*`, in the target's checkpoint):
           entry i: input_proj(hidden_layernorm(h_i) ‖ token_layernorm(embed(token i+1))) -> a Qwen2 decoder layer
           -> final_layernorm -> m_i; logits = the target's lm_head(m_i). h_i is the target's last hidden state
           before its final norm (read here from the state after it: `from_target`), later the head's own m.

The target's states are the executor's `hidden_layers` (the residual stream after a layer; the last one's
after the final norm, transformers' `hidden_states[l + 1]`): `HeadConfig.feature_layers` says which.
Published key names (SafeAILab/EAGLE, FasterDecoding/Medusa), vLLM's renamed ones and the speculators
library's layout (`speculators_layout`) are read; `save_head` writes the published ones. The decoder layer is
Llama's (biases where its config says) or Qwen3's (`HeadConfig.layer_type`). Facts and sources: docs/drafts.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specdec.engine import llama_model
from specdec.engine.llama_forward import MIMO
from specdec.engine.llama_model import RMSNorm, rotate

EAGLE, EAGLE3, MEDUSA, MLP, MTP = "eagle", "eagle3", "medusa", "mlp_speculator", "mtp"
KINDS = (EAGLE, EAGLE3, MEDUSA, MLP, MTP)
TRAINED = (EAGLE, EAGLE3, MEDUSA)  # the kinds `python -m specdec.train` trains (IBM's speculators train elsewhere)
LLAMA, QWEN3 = "llama", "qwen3"  # the decoder layers a head may have (HeadConfig.layer_type)
LAYER_TYPES = (LLAMA, QWEN3)
LAYER_CLASSES = {"LlamaDecoderLayer": LLAMA, "Qwen3DecoderLayer": QWEN3}  # transformers' classes of those layers
QWEN2 = "qwen2"  # an MTP layer's: Qwen2's decoder layer (biases on the query, key and value projections only)
# The models whose MTP layers are read (config.json's model_type; num_nextn_predict_layers says it has them), the
# key prefix of their first layer in the model's checkpoint, and the final norm's key (`from_target` reads it)
MTP_MODEL_TYPES = (MIMO,)
MTP_PREFIX, MTP_TARGET_NORM = "model.mtp_layers.0.", "model.norm.weight"
MTP_OWN = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")  # beside its decoder layer
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt")


class HeadError(ValueError):
    """A head that cannot be read, or does not fit its target."""


@dataclass(frozen=True)
class HeadConfig:
    kind: str
    hidden_size: int
    vocab_size: int  # the target's vocabulary (the head's logits are over it, scattered for EAGLE-3)
    draft_vocab_size: int = 0  # EAGLE-3's reduced head; 0: the whole vocabulary
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    fc_bias: bool = False  # some EAGLE-1 heads have fc.bias
    # EAGLE-3: the target layers whose output it reads (the config's eagle_aux_hidden_state_layer_ids);
    # empty: the default, the states entering layers 2, N // 2 and N - 3 of an N-layer target
    aux_layers: tuple[int, ...] = ()
    target_hidden_size: int = 0  # EAGLE-3: the target's width, when it differs from the head's
    # EAGLE-3, as vLLM and the speculators library read them: the layer's residual is hidden_norm(g) rather
    # than g; an RMSNorm (`input_norm`, 3h) over the target's states before fc
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    # EAGLE's decoder layer, as its config's model_type and biases say (transformers' layers of those types):
    # a Llama layer, or Qwen3's (an RMSNorm over each head's queries and keys before the rotary embedding)
    layer_type: str = LLAMA
    attention_bias: bool = False  # q, k, v and o projections with biases
    mlp_bias: bool = False  # gate, up and down projections with biases (a Llama layer's option)
    # EAGLE-3: its decoder layers (the config's num_hidden_layers): the first over 2h, the others plain
    # layers over h (the speculators library trains heads of several); EAGLE-1 has one
    num_layers: int = 1
    medusa_heads: int = 0
    medusa_layers: int = 0
    # an MLP speculator's: its stages (n_predict), their width (inner_dim), stages 1.. sharing one embedding,
    # projection and norm (tie_weights), and a norm over the target's state before stage 0 (scale_input)
    mlp_stages: int = 0
    inner_size: int = 0
    tie_weights: bool = False
    scale_input: bool = False
    raw: dict = field(default_factory=dict, compare=False)  # config.json as read (rotary settings)

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """The executor's hidden_layers (outputs of those layers) whose states are the head's features."""
        if self.kind != EAGLE3:
            return (target_layers - 1,)  # the last layer's output after the final norm
        if self.aux_layers:
            return tuple(self.aux_layers)
        return (1, target_layers // 2 - 1, target_layers - 4)  # entering 2, N // 2, N - 3

    @property
    def feature_width(self) -> int:
        """Floats per position of the target features the head reads."""
        width = self.target_hidden_size or self.hidden_size
        return 3 * width if self.kind == EAGLE3 else width

    @property
    def head_dim(self) -> int:
        return self.raw.get("head_dim") or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, raw: dict, where: str) -> HeadConfig:
        if "speculators_model_type" in raw:
            raw = speculators_layout(raw, where)

        def need(key):
            if key not in raw:
                raise HeadError(f"{where}: config.json has no {key!r}")
            return raw[key]
        if raw.get("num_nextn_predict_layers"):
            return cls._mtp(raw, where, need)
        if raw.get("model_type") in MTP_MODEL_TYPES:
            raise HeadError(f"{where}: a {raw['model_type']} model without MTP layers (num_nextn_predict_layers "
                            f"{raw.get('num_nextn_predict_layers')!r}): nothing in it drafts")
        if "medusa_num_heads" in raw:
            return cls(MEDUSA, need("hidden_size"), need("vocab_size"), medusa_heads=int(raw["medusa_num_heads"]),
                       medusa_layers=int(raw.get("medusa_num_layers", 1)), raw=raw)
        if raw.get("model_type") == MLP or "MLPSpeculatorPreTrainedModel" in raw.get("architectures", []):
            stages, width = int(need("n_predict")), int(raw.get("inner_dim") or need("emb_dim"))
            if stages < 1 or (raw.get("tie_weights") and stages < 2):
                raise HeadError(f"{where}: n_predict {stages}: an MLP speculator has at least one stage (two to "
                                "tie their weights)")
            return cls(MLP, need("emb_dim"), need("vocab_size"), mlp_stages=stages, inner_size=width,
                       tie_weights=bool(raw.get("tie_weights", False)), scale_input=bool(raw.get("scale_input", False)),
                       raw=raw)
        eagle3 = "draft_vocab_size" in raw or any("eagle3" in a.lower() for a in raw.get("architectures", []))
        # the layer's MLP computes SiLU, as every published EAGLE head's does; another would draft wrongly
        if raw.get("hidden_act", "silu") != "silu":
            raise HeadError(f"{where}: hidden_act {raw['hidden_act']!r}: this server's EAGLE heads compute "
                            "their MLP with 'silu'")
        # a Llama layer where the architecture names one, whatever model_type says (heads for Qwen3 targets in
        # EAGLE's layout copy the target's); a Qwen3 layer as the speculators library trains it for Qwen3 targets
        llama_class = any(a.startswith("Llama") for a in raw.get("architectures", []))
        layer_type = QWEN3 if raw.get("model_type") == QWEN3 and not llama_class else LLAMA
        return cls(EAGLE3 if eagle3 else EAGLE, need("hidden_size"), need("vocab_size"),
                   draft_vocab_size=int(raw.get("draft_vocab_size") or 0) if eagle3 else 0,
                   num_attention_heads=need("num_attention_heads"),
                   num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                   intermediate_size=need("intermediate_size"), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                   fc_bias=bool(raw.get("bias", False)) and not eagle3,
                   aux_layers=_aux_layers(raw) if eagle3 else (),
                   target_hidden_size=int(raw.get("target_hidden_size") or 0),
                   norm_before_residual=eagle3 and bool(raw.get("norm_before_residual", False)),
                   norm_before_fc=eagle3 and bool(raw.get("norm_before_fc", False)), layer_type=layer_type,
                   attention_bias=bool(raw.get("attention_bias", False)),
                   mlp_bias=layer_type == LLAMA and bool(raw.get("mlp_bias", False)),
                   num_layers=int(raw.get("num_hidden_layers") or 1) if eagle3 else 1, raw=raw)

    @classmethod
    def _mtp(cls, raw: dict, where: str, need) -> HeadConfig:
        """A model's config.json whose checkpoint holds MTP layers: the first of them, as a head."""
        if raw.get("model_type") not in MTP_MODEL_TYPES:
            raise HeadError(f"{where}: model_type {raw.get('model_type')!r}: this server reads the MTP layers of "
                            f"{', '.join(MTP_MODEL_TYPES)} models (num_nextn_predict_layers with a Qwen2 decoder "
                            "layer)")
        if raw.get("hidden_act", "silu") != "silu":
            raise HeadError(f"{where}: hidden_act {raw['hidden_act']!r}: an MTP layer here computes its MLP with "
                            "'silu'")
        return cls(MTP, need("hidden_size"), need("vocab_size"), num_attention_heads=need("num_attention_heads"),
                   num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                   intermediate_size=need("intermediate_size"), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                   layer_type=QWEN2, raw=raw)

    def to_json(self) -> dict:
        if self.kind == MTP:  # a model's config.json as MiMo's says it (the target's layers, where known)
            return {**self.raw, "architectures": ["MiMoForCausalLM"], "model_type": MTP_MODEL_TYPES[0],
                    "num_nextn_predict_layers": int(self.raw.get("num_nextn_predict_layers") or 1),
                    "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                    "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                    "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
                    "hidden_act": "silu"}
        if self.kind == MEDUSA:
            return {**self.raw, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                    "medusa_num_heads": self.medusa_heads, "medusa_num_layers": self.medusa_layers}
        if self.kind == MLP:  # as IBM's fms-extras writes its speculators (vLLM reads these)
            return {**self.raw, "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MLP,
                    "emb_dim": self.hidden_size, "inner_dim": self.inner_size, "vocab_size": self.vocab_size,
                    "n_predict": self.mlp_stages, "tie_weights": self.tie_weights, "scale_input": self.scale_input,
                    "n_candidates": self.mlp_stages, "top_k_tokens_per_head": [1] * self.mlp_stages}
        raw = {key: value for key, value in self.raw.items() if key != AUX_IDS}  # written nested, below
        out = {**raw, "model_type": self.layer_type, "num_hidden_layers": self.num_layers,
               "hidden_size": self.hidden_size,
               "vocab_size": self.vocab_size, "num_attention_heads": self.num_attention_heads,
               "num_key_value_heads": self.num_key_value_heads, "intermediate_size": self.intermediate_size,
               "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu", "attention_bias": self.attention_bias}
        if self.layer_type == LLAMA:
            out["mlp_bias"] = self.mlp_bias
        model = "Qwen3ForCausalLM" if self.layer_type == QWEN3 else "LlamaForCausalLM"
        if self.kind == EAGLE3:
            out.update(architectures=[model + "Eagle3"], draft_vocab_size=self.draft_vocab_size or self.vocab_size)
            if self.aux_layers:
                out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
            if self.target_hidden_size:
                out["target_hidden_size"] = self.target_hidden_size
            out.update({name: True for name in ("norm_before_residual", "norm_before_fc") if getattr(self, name)})
        else:
            out.update(architectures=[model], bias=self.fc_bias)
        return out


AUX_IDS = "eagle_aux_hidden_state_layer_ids"


def _aux_layers(raw: dict) -> tuple[int, ...]:
    """An EAGLE-3 config's layer ids: the outputs of those layers (the executor's hidden_layers), as ModelOpt
    exports them (in `eagle_config`, or at the top: NVIDIA's published heads) and SGLang reads them. (vLLM reads
    them as the states entering those layers; the speculators library writes them so: `speculators_layout`.)"""
    ids = (raw.get("eagle_config") or {}).get(AUX_IDS) or raw.get(AUX_IDS) or ()
    return tuple(int(i) for i in ids)


def speculators_layout(raw: dict, where: str) -> dict:
    """A config in the speculators library's layout (vLLM loads it as it is; RedHatAI publishes heads in it)
    as the flat one EAGLE's authors publish: the decoder layer's settings (`transformer_layer_config`, a
    Llama or Qwen3 layer) at the top, with the head's own (draft_vocab_size, norm_before_residual, norm_before_fc,
    target_hidden_size, the layer ids). An EAGLE-1 (or HASS) head's `fusion_bias` is its fc's bias; its
    `layernorms` variant (norms around the layer EAGLE-1 has not) is refused, as is any other kind."""
    kind = raw["speculators_model_type"]
    if kind not in (EAGLE, EAGLE3):
        raise HeadError(f"{where}: speculators_model_type {kind!r}: this server reads the 'eagle' and 'eagle3' "
                        "kinds of that layout")
    layer = dict(raw.get("transformer_layer_config") or {})
    # the layer's class where the config names one (its EAGLE-1 heads do; "auto": the layer config's type)
    named = raw.get("transformer_layer_architecture") or "auto"
    if named != "auto":
        if named not in LAYER_CLASSES:
            raise HeadError(f"{where}: transformer_layer_architecture {named!r}: this server's heads have a "
                            f"decoder layer of class {' or '.join(LAYER_CLASSES)}")
        layer["model_type"] = LAYER_CLASSES[named]
    if layer.get("model_type", LLAMA) not in LAYER_TYPES:
        raise HeadError(f"{where}: transformer_layer_config.model_type {layer['model_type']!r}: this server's "
                        f"heads have a decoder layer of type {' or '.join(LAYER_TYPES)}")
    # EAGLE-1's layer config is often its target's (num_hidden_layers 32: not the head's); EAGLE-3's says its own
    flat = {key: value for key, value in layer.items()
            if key != "architectures" and (kind == EAGLE3 or key != "num_hidden_layers")}
    model = "Qwen3ForCausalLM" if layer.get("model_type") == QWEN3 else "LlamaForCausalLM"
    if kind == EAGLE:
        if raw.get("layernorms"):
            raise HeadError(f"{where}: an EAGLE head with `layernorms` (an embedding norm, an input norm and a "
                            "norm before the lm_head): this server reads EAGLE-1's layer without them")
        return {**flat, "architectures": [model], "bias": bool(raw.get("fusion_bias", False))}
    flat.update(architectures=[model + "Eagle3"], draft_vocab_size=int(raw.get("draft_vocab_size") or
                                                                     layer.get("vocab_size") or 0))
    for key in ("norm_before_residual", "norm_before_fc", "target_hidden_size"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    # its layer ids: the states entering those layers (transformers' hidden_states[i], as vLLM captures them;
    # i = N: the last layer's output after the final norm), kept as the outputs of layers i - 1
    entering = [int(i) for i in raw.get(AUX_IDS) or ()]
    if any(i < 1 for i in entering):
        raise HeadError(f"{where}: {AUX_IDS} {entering}: the embeddings (id 0) are not a layer's states this "
                        "server serves")
    if entering:
        flat["eagle_config"] = {AUX_IDS: [i - 1 for i in entering]}
    return flat


class _Attention(nn.Module):
    def __init__(self, config: HeadConfig, in_width: int):
        super().__init__()
        heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv, d
        bias = config.attention_bias
        qkv_bias = bias or config.layer_type == QWEN2
        self.q_proj = nn.Linear(in_width, heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(in_width, kv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(in_width, kv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * d, config.hidden_size, bias=bias)
        if config.layer_type == QWEN3:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., m, in) -> queries (..., heads, m, D), keys and values (..., kv_heads, m, D), before the
        rotary embedding (a Qwen3 layer's queries and keys normed per head)."""
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, window: Window) -> torch.Tensor:
        """x (m, in) -> (m, h): its keys and values go where `window` puts them, and each row attends to
        the keys `window` returns where its mask allows (HeadCache.window: the cache before it and
        itself)."""
        m = x.shape[0]
        q, k, v = (t[None] for t in self.project(x))  # (1, heads or kv_heads, m, D)
        q, k = rotate(q, k, cos[None], sin[None])
        keys, values, visible = window(k[0].transpose(0, 1), v[0].transpose(0, 1))  # (L, kv, D) each, (m, L)
        if torch.is_grad_enabled() or q.device.type != "cpu":  # training, and GPUs (their graphs as measured)
            groups = self.heads // self.kv_heads
            keys = keys.transpose(0, 1).repeat_interleave(groups, 0)[None]
            values = values.transpose(0, 1).repeat_interleave(groups, 0)[None]
            out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        else:  # drafting on a CPU: the same attention without copying each key `groups` times (~10 % of a call)
            out = nn.functional.scaled_dot_product_attention(q, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                             attn_mask=visible, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out[0].transpose(0, 1).reshape(m, -1))


class _MLP(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """EAGLE's decoder layer. The first takes EAGLE-1's fc output (no input norm) or EAGLE-3's
    [norm(embed) ‖ norm(hidden)] (2h) into attention; an EAGLE-3 head's further layers (`plain`) are a
    decoder layer as its type has it, over h."""

    def __init__(self, config: HeadConfig, plain: bool = False):
        super().__init__()
        h = config.hidden_size
        first3 = config.kind == EAGLE3 and not plain
        self.self_attn = _Attention(config, 2 * h if first3 else h)
        self.mlp = _MLP(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if first3 or plain:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        if first3:
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)

    def plain(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, window: Window) -> torch.Tensor:
        """A plain layer's step: x (m, h) -> (m, h)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, window)
        return x + self.mlp(self.post_attention_layernorm(x))


# Where a head's attention puts a step's keys and values and what it attends to, in one of its layers:
# (k, v) (m, kv, D) each -> (keys (L, kv, D), values (L, kv, D), visible (m, L) bool)
Window = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# The same for every layer of a step: (layer, k, v) -> what a Window returns (EagleHead.step binds the layer)
Windows = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class HeadCache:
    """One sequence's keys and values in a head's layers: (layers, capacity, kv_heads, D) each, grown by
    doubling (and by layers as they are first written), or fixed views given (a slot of head_graphs.HeadPool:
    nothing is reallocated, captured steps read it); `length` entries valid in every layer (a rollback is a
    smaller length)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.keys, self.values = keys, values
        self.fixed = keys is not None
        self.length = 0

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (m, kv, D) at entries start.. of `layer` -> that layer's keys and values (end, kv, D) so far."""
        end = start + k.shape[0]
        if self.keys is None or end > self.keys.shape[1] or layer >= self.keys.shape[0]:
            if self.fixed:
                raise ValueError(f"the head's cache holds {self.keys.shape[1]} positions of {self.keys.shape[0]} "
                                 f"layers, {end} asked for in layer {layer}")
            layers, capacity = layer + 1, max(64, 1 << (end - 1).bit_length())
            if self.keys is not None:
                layers, capacity = max(layers, self.keys.shape[0]), max(capacity, self.keys.shape[1])
            keys = k.new_zeros(layers, capacity, *k.shape[1:])
            values = v.new_zeros(layers, capacity, *v.shape[1:])
            if self.keys is not None:  # all of it: an earlier layer may have written this step's entries already
                old_layers, old_capacity = self.keys.shape[:2]
                keys[:old_layers, :old_capacity], values[:old_layers, :old_capacity] = self.keys, self.values
            self.keys, self.values = keys, values
        self.keys[layer, start:end], self.values[layer, start:end] = k, v
        self.length = end
        return self.keys[layer, :end], self.values[layer, :end]

    def window(self, start: int) -> Windows:
        """Rows at positions start.. written here; each sees the cache before it and itself."""
        def attend(layer, k, v):
            keys, values = self.write(start, k, v, layer)
            m, end = k.shape[0], start + k.shape[0]
            visible = torch.arange(end, device=k.device) <= (start + torch.arange(m, device=k.device))[:, None]
            return keys, values, visible
        return attend

    @property
    def bytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
DEFAULT_ROPE_THETA = 10000.0  # a head's config without one: transformers' LlamaConfig's default


def _rotary(config: "HeadConfig") -> nn.Module:
    """The head's rotary embedding: llama_model's for the RoPE types it computes (no transformers import in a
    draft_model's process), else transformers' own."""
    raw = {key: value for key, value in config.raw.items() if key in ROPE_KEYS}
    rope = llama_model.rope_parameters(raw, default_theta=DEFAULT_ROPE_THETA)
    if isinstance(rope, dict):
        return llama_model.RotaryEmbedding(config.head_dim, rope)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig(**raw, hidden_size=config.hidden_size, head_dim=config.head_dim,
                                            num_attention_heads=config.num_attention_heads))


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head, or an MTP layer (drafting as EAGLE-1 does, one decoder layer over the
    target's last state). `embed` (V, h) is the target's token embedding; EAGLE-1 and MTP also read the
    target's `lm_head` (V, h); EAGLE-3 has its own over the draft vocabulary."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if config.kind == EAGLE3:
            if config.norm_before_fc:
                self.input_norm = RMSNorm(config.feature_width, config.rms_norm_eps)
            self.fc = nn.Linear(config.feature_width, h, bias=False)
            self.midlayer = _Layer(config)
            if config.num_layers > 1:  # keys layers.1. .. as the speculators library names them
                self.layers = nn.ModuleDict({str(i): _Layer(config, plain=True) for i in range(1, config.num_layers)})
            self.norm = RMSNorm(h, config.rms_norm_eps)
            draft_vocab = config.draft_vocab_size or config.vocab_size
            self.lm_head = nn.Linear(h, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool) if draft_vocab == config.vocab_size
                                 else torch.zeros(config.vocab_size, dtype=torch.bool))
        elif config.kind == MTP:
            self.token_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.input_proj = nn.Linear(2 * h, h, bias=False)
            self.layers = nn.ModuleList([_Layer(config, plain=True)])
            self.final_layernorm = RMSNorm(h, config.rms_norm_eps)
            # the target's final norm weight (read from the checkpoint with the layer): `from_target` undoes it
            self.register_buffer("target_norm", torch.ones(h))
        else:
            self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
            self.layers = nn.ModuleList([_Layer(config)])
        self.rotary = _rotary(config)
        self.embed: torch.Tensor | None = None  # the target's (set by attach)
        # the token embedding its file carries (load_head), if any: `load_head_for` keeps it where it is not the
        # target's (a head that trained its own: the speculators library's embed_requires_grad)
        self.file_embed: torch.Tensor | None = None
        self.target_head: torch.Tensor | None = None

    def decoder_layers(self) -> list[_Layer]:
        """Its decoder layers in order: EAGLE-3's first (`midlayer`) and plain ones after it; EAGLE-1's one."""
        if self.config.kind != EAGLE3:
            return [self.layers[0]]
        return [self.midlayer, *(self.layers.values() if hasattr(self, "layers") else ())]

    def draft_target_ids(self) -> torch.Tensor:
        """EAGLE-3: the target id of each draft id (V_d,), draft id + d2t[draft id]; on a CPU kept while d2t
        is unchanged (a draft step asks for it every time). Not on a GPU: one made while a CUDA graph is
        captured would hold nothing until the graph first ran."""
        if self.d2t.device.type != "cpu":
            return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        key = (self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_target_ids_key", None) != key:
            self._target_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
            self._target_ids_key = key
        return self._target_ids

    def attach(self, embed: torch.Tensor, target_head: torch.Tensor | None) -> None:
        """Borrow the target's tensors (plain tensors, not parameters: not the head's to save or train)."""
        self.embed = embed.detach()
        self.target_head = None if target_head is None else target_head.detach()

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """The hidden input of the target's positions: EAGLE-3's fc over its (m, 3h) states; EAGLE-1's as they are;
        an MTP layer's hidden_layernorm of the target's state before its final norm, from the state after it.

        Both norms scale the same h / rms(h) (one eps: the model's), so hidden_layernorm(h) = f * w_h / w_f
        exactly, f = final_norm(h): the target's forward keeps serving its post-norm state. A weight of the
        final norm at 0 loses that entry; it is drafted as 0 (a draft's error costs acceptance, never output)."""
        if self.config.kind == MTP:
            norm = self.target_norm
            scale = torch.where(norm != 0, self.hidden_layernorm.weight / torch.where(norm != 0, norm, 1), 0)
            return features * scale.to(features.dtype)
        if self.config.kind != EAGLE3:
            return features
        return self.fc(self.input_norm(features) if self.config.norm_before_fc else features)

    def residual(self, hidden: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: what its layer adds attention's output to, given its hidden input g and hidden_norm(g)."""
        return normed if self.config.norm_before_residual else hidden

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: HeadCache, start: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries start.. start+m-1: tokens (m,) (token i+1 of entry i), hidden (m, h) (`from_target`'s or
        the head's own output). Returns (the next hidden (m, h), logits over the target's vocabulary (m, V))."""
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        return self.step(tokens, hidden, positions, cache.window(start))

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, window: Windows
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the positions (m,) and the keys' place given: what a captured step replays."""
        embeds = nn.functional.embedding(tokens, self.embed).to(hidden.dtype)
        cos, sin = self.rotary(hidden, positions[None])
        cos, sin = cos[0], sin[0]
        if self.config.kind == MTP:
            return self._mtp_step(embeds, hidden, positions, cos, sin, window)
        first, *plain = self.decoder_layers()
        if self.config.kind == EAGLE3:
            normed = first.hidden_norm(hidden)
            x = torch.cat([first.input_layernorm(embeds), normed], dim=-1)
            residual = self.residual(hidden, normed)
        else:
            x = residual = self.fc(torch.cat([embeds, hidden], dim=-1))
        x = residual + first.self_attn(x, cos, sin, partial(window, 0))
        out = x + first.mlp(first.post_attention_layernorm(x))
        for index, layer in enumerate(plain, start=1):
            out = layer.plain(out, cos, sin, partial(window, index))
        if self.config.kind != EAGLE3:
            return out, nn.functional.linear(out, self.target_head)
        draft_logits = self.lm_head(self.norm(out))
        if draft_logits.shape[-1] == self.config.vocab_size:
            return out, draft_logits
        return out, scatter_logits(draft_logits, self.draft_target_ids(), self.config.vocab_size)

    def _mtp_step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, window: Windows) -> tuple[torch.Tensor, torch.Tensor]:
        """An MTP layer's step; `hidden` is already hidden_layernorm's output (`from_target`'s, or this step's
        own for the next entry). The embedding at position 0 is zeroed, as vLLM's MiMo MTP has it."""
        embeds = embeds * (positions != 0).to(embeds.dtype)[:, None]
        x = self.input_proj(torch.cat([hidden, self.token_layernorm(embeds)], dim=-1))
        state = self.final_layernorm(self.layers[0].plain(x, cos, sin, partial(window, 0)))
        return self.hidden_layernorm(state), nn.functional.linear(state, self.target_head)


def scatter_logits(draft_logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An EAGLE-3 head's logits over its draft vocabulary (..., V_d) -> over the target's (..., V): column i at
    target id ids[i], -inf at every id the draft vocabulary lacks."""
    logits = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    return logits.index_copy(-1, ids, draft_logits)


class _ResBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.linear = nn.Linear(h, h)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """Medusa's heads: heads[j](f_t) are the logits of token t + j + 2 (the target's own head gives t + 1)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.heads = nn.ModuleList([nn.Sequential(*[_ResBlock(h) for _ in range(config.medusa_layers)],
                                                  nn.Linear(h, config.vocab_size, bias=False))
                                    for _ in range(config.medusa_heads)])

    def forward(self, feature: torch.Tensor, count: int) -> torch.Tensor:
        """feature (h,) -> the first `count` heads' logits (count, V)."""
        return torch.stack([head(feature) for head in self.heads[:count]])


class _StageNorm(nn.Module):
    """The MLP speculator's norm: x / rms(x) (no mean taken out), then weight and bias where it has them."""

    def __init__(self, width: int, affine: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(width))
            self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias if hasattr(self, "weight") else x


class MlpSpeculator(nn.Module):
    """IBM's MLP speculator ("Accelerating Production LLMs with Combined Token/Embedding Speculators"): stage
    j reads its state and the token before it and gives the next state and that token's logits. Tied
    (tie_weights): one embedding and norm for every stage, one projection for stages 1.. (stage 0's reads the
    target's width), held once (`emb.0`, `ln.0`, `proj.0`, `proj.1`: the names a tied file holds, as vLLM
    reads it); each stage keeps its own head."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        n, h, inner, vocab = config.mlp_stages, config.hidden_size, config.inner_size, config.vocab_size
        tied = config.tie_weights
        # stage j's embedding and norm, and its projection: an index into the modules below
        self.shared = [0 if tied else j for j in range(n)]
        self.projected = [min(j, 1) if tied else j for j in range(n)]
        self.emb = nn.ModuleList([nn.Embedding(vocab, inner) for _ in range(1 if tied else n)])
        self.proj = nn.ModuleList([nn.Linear(h if j == 0 else inner, inner, bias=False)
                                   for j in range(min(n, 2) if tied else n)])
        self.head = nn.ModuleList([nn.Linear(inner, vocab, bias=False) for _ in range(n)])
        self.ln = nn.ModuleList([_StageNorm(inner) for _ in range(1 if tied else n)])
        self.ln0 = _StageNorm(h, affine=False) if config.scale_input else None
        # the state's and the token's shares of a stage's input (its norm divides out their common scale)
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (inner / 2))

    def start(self, feature: torch.Tensor) -> torch.Tensor:
        """The target's feature (m, h) -> stage 0's state."""
        return self.ln0(feature) / math.sqrt(2) if self.ln0 is not None else feature

    def stage(self, j: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage j over m rows: state (m, h or inner), tokens (m,) the token each row follows -> (next state
        (m, inner), logits (m, V) of the token after it)."""
        shared = self.shared[j]
        mixed = self.proj[self.projected[j]](state) + self.emb[shared](tokens) * (self.emb_weight / self.state_weight)
        state = nn.functional.gelu(self.ln[shared](mixed))
        return state, self.head[j](state)

    def forward(self, feature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: feature (m, h) and tokens (m, S) the tokens each stage reads -> logits (S, m, V)."""
        state, out = self.start(feature), []
        for j in range(tokens.shape[1]):
            state, logits = self.stage(j, state, tokens[:, j])
            out.append(logits)
        return torch.stack(out)


def rows_forward(head: EagleHead | MedusaHeads | MlpSpeculator, most: int = 16) -> Callable[[int], object]:
    """forward(n): the head over n random rows at the start of a fresh cache (Medusa: its heads on one
    feature, whatever n; an MLP speculator: its first stage over n rows), what `onednn_linear.time_kernels`
    times for a served head."""
    parameter = next(head.parameters())
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(most, head.config.hidden_size, generator=generator).to(parameter)
    if isinstance(head, MedusaHeads):
        return lambda n: head(hidden[0], head.config.medusa_heads)
    tokens = torch.randint(0, head.config.vocab_size, (most,), generator=generator).to(parameter.device)
    if isinstance(head, MlpSpeculator):  # a stage over n rows
        return lambda n: head.stage(0, hidden[:n], tokens[:n])
    return lambda n: head(tokens[:n], hidden[:n], HeadCache(), 0)


# In a speculators-layout file: the target's own tensors, kept for training (the embedding is the target's too)
VERIFIER_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight")


def _published(kind: str, state: dict) -> dict:
    """Key names as the authors publish them, from vLLM's renamed ones or the speculators library's where a
    file has those (EAGLE-1's fusion_fc and transformer, its lm_head the target's)."""
    out = {}
    speculators_eagle = kind == EAGLE and "fusion_fc.weight" in state
    for key, value in state.items():
        key = key.removeprefix("model.")
        if kind == MLP:  # (fms-extras' checkpoints of the speculator inside a model)
            key = key.removeprefix("speculator.")
        if key in VERIFIER_KEYS or (speculators_eagle and key == "lm_head.weight"):
            continue
        if kind == EAGLE3:
            key = key.replace("layers.0.", "midlayer.", 1) if key.startswith("layers.0.") else key
        if speculators_eagle:
            key = "fc." + key.removeprefix("fusion_fc.") if key.startswith("fusion_fc.") else key
            key = "layers.0." + key.removeprefix("transformer.") if key.startswith("transformer.") else key
        if kind == MEDUSA:
            parts = key.split(".")
            if parts[0] == "blocks":  # blocks.{i}.layers.{j}.weight -> {i}.{j}.linear.weight
                key = f"{parts[1]}.{parts[3]}.linear.{parts[4]}"
            elif parts[0] == "lm_heads":  # lm_heads.{i}.weight -> {i}.{L}.weight (filled in below)
                key = f"{parts[1]}.head.{parts[2]}"
        out[key] = value
    return out


def _mtp_key(key: str) -> str:
    """A model checkpoint's key of its first MTP layer (or its final norm) -> the head's."""
    if key == MTP_TARGET_NORM:
        return "target_norm"
    key = key.removeprefix(MTP_PREFIX)
    return key if key.startswith(MTP_OWN) else "layers.0." + key


def _published_mtp_key(key: str) -> str:
    """The head's key -> the model checkpoint's (`_mtp_key` backwards)."""
    if key == "target_norm":
        return MTP_TARGET_NORM
    return MTP_PREFIX + (key.removeprefix("layers.0.") if key.startswith("layers.0.") else key)


def _read_mtp_weights(path: Path) -> dict:
    """A model directory's first MTP layer and its final norm, read alone from its safetensors (one file or
    shards named by model.safetensors.index.json): the rest of a 7B model's weights stay on disk."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({file for key, file in weight_map.items()
                        if key.startswith(MTP_PREFIX) or key == MTP_TARGET_NORM})
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        if not (path / name).exists():
            raise HeadError(f"{path}: no {name} (a model's MTP layer is read from its safetensors)")
        with safe_open(str(path / name), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(MTP_PREFIX) or key == MTP_TARGET_NORM:
                    state[_mtp_key(key)] = handle.get_tensor(key)
    if not any(key != "target_norm" for key in state):
        raise HeadError(f"{path}: config.json says num_nextn_predict_layers, its weights hold no {MTP_PREFIX}* tensors "
                        "(a checkpoint saved without its MTP layers)")
    return state


def _read_weights(path: Path) -> dict:
    for name in WEIGHT_FILES:
        file = path / name
        if file.exists():
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
    raise HeadError(f"{path}: no head weights (looked for {', '.join(WEIGHT_FILES)})")


def load_head(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
              ) -> EagleHead | MedusaHeads | MlpSpeculator:
    """Read a head directory (config.json and its weights) in its published layout or vLLM's."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise HeadError(f"{path}: no config.json (a draft head directory holds config.json and its weights)")
    config = HeadConfig.from_json(json.loads(config_file.read_text()), str(path))
    state = _read_mtp_weights(path) if config.kind == MTP else _published(config.kind, _read_weights(path))
    # many files carry the target's embedding (it is read there) and some a trained one: kept to compare
    file_embed = state.pop("embed_tokens.weight", None)
    if config.kind == MEDUSA:
        state = {key.replace(".head.", f".{config.medusa_layers}."): value for key, value in state.items()}
        module = MedusaHeads(config)
        state = {f"heads.{key}": value for key, value in state.items()}
    elif config.kind == MLP:
        module = MlpSpeculator(config)
        if config.tie_weights:  # a file holding a tied tensor under every stage's name: the first's is read (vLLM's)
            held = set(module.state_dict())
            state = {key: value for key, value in state.items()
                     if key in held or not key.startswith(("emb.", "proj.", "ln."))}
    else:
        module = EagleHead(config)
        held = len({"0" if key.startswith("midlayer.") else key.split(".")[1] for key in state
                    if key.startswith(("midlayer.", "layers."))})  # EAGLE-3's first layer is its midlayer
        if config.kind == EAGLE3 and held != config.num_layers:
            raise HeadError(f"{path}: its weights hold {held} decoder layers, its config.json's num_hidden_layers "
                            f"says {config.num_layers}")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if isinstance(module, EagleHead):
        module.file_embed = file_embed
    # d2t and t2d are left out of a file whose draft vocabulary is the target's (the identity: as made)
    mapped = config.kind == EAGLE3 and 0 < config.draft_vocab_size < config.vocab_size
    missing = [key for key in missing if not key.startswith("rotary.") and (mapped or key not in ("d2t", "t2d"))]
    if missing or unexpected:
        raise HeadError(f"{path}: not a {config.kind} head's weights: missing {sorted(missing)[:6]}, "
                        f"unexpected {sorted(unexpected)[:6]}")
    return module.to(device=device, dtype=dtype).eval()


PUBLISHED, SPECULATORS = "eagle", "speculators"  # save_head's layouts
LAYOUTS = (PUBLISHED, SPECULATORS)


def save_head(head: EagleHead | MedusaHeads, path: str | Path, layout: str = PUBLISHED, verifier: str = "",
              speculative_tokens: int = 3) -> Path:
    """Write `head` as its authors publish it: config.json and model.safetensors (EAGLE-1, EAGLE-3 with
    `midlayer.` keys, d2t and t2d) or medusa_lm_head.safetensors (keys {i}.{j}.linear.*, {i}.{L}.weight); an
    MTP layer as a model checkpoint holds it (`model.mtp_layers.0.*` and the final norm it reads, MiMo's
    config.json: the part of a model's directory it is read from). layout SPECULATORS: an EAGLE head as the
    speculators library writes it (`speculators_config`, the verifier `verifier` and `speculative_tokens`), what
    vLLM serves as it is with the layer ids it reads as meant
    (a published EAGLE-3 config's ids are read by vLLM as the states entering those layers, by SGLang and
    this server as those layers' outputs: `_aux_layers`)."""
    from safetensors.torch import save_file
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if layout == SPECULATORS and (isinstance(head, (MedusaHeads, MlpSpeculator)) or head.config.kind == MTP):
        raise ValueError("the speculators layout holds EAGLE heads; Medusa heads, MLP speculators and MTP layers "
                         "are written as their authors do")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().contiguous().cpu() for key, value in head.state_dict().items()
             if not key.startswith("rotary.")}
    if isinstance(head, MedusaHeads):
        state = {key.removeprefix("heads."): value for key, value in state.items()}
        name = "medusa_lm_head.safetensors"
    elif head.config.kind == MTP:  # the MTP layer and the final norm, under the model checkpoint's names
        state = {_published_mtp_key(key): value for key, value in state.items()}
        name = "model.safetensors"
    else:  # (a tied MLP speculator's shared tensors once: emb.0, ln.0, proj.0, proj.1, as vLLM reads them)
        name = "model.safetensors"
    config = head.config.to_json()
    if layout == SPECULATORS:
        state, config = _speculators_files(head.config, state, verifier, speculative_tokens)
    save_file(state, str(path / name))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _speculators_files(config: HeadConfig, state: dict, verifier: str, speculative_tokens: int
                       ) -> tuple[dict, dict]:
    """An EAGLE head's tensors and config.json in the speculators library's layout (`speculators_layout`
    reads it back)."""
    eagle3 = config.kind == EAGLE3
    layer = {key: value for key, value in config.to_json().items()
             if key not in ("architectures", "draft_vocab_size", "eagle_config", "bias", "target_hidden_size",
                            "norm_before_residual", "norm_before_fc")}
    layer.update(num_hidden_layers=config.num_layers, head_dim=config.head_dim)
    out = {"architectures": ["Eagle3Speculator" if eagle3 else "EagleSpeculator"],
           "speculators_model_type": config.kind, "transformer_layer_config": layer,
           "speculators_config": {"algorithm": config.kind, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": speculative_tokens}],
                                  "verifier": {"name_or_path": verifier or None}}}
    if eagle3:
        out.update(draft_vocab_size=config.draft_vocab_size or config.vocab_size,
                   norm_before_residual=config.norm_before_residual, norm_before_fc=config.norm_before_fc,
                   target_hidden_size=config.target_hidden_size or None)
        if config.aux_layers:  # the states entering the layers after those whose outputs it reads
            out[AUX_IDS] = [i + 1 for i in config.aux_layers]
        state = {"layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key: value
                 for key, value in state.items()}
    else:
        layer_class = next(name for name, kind in LAYER_CLASSES.items() if kind == config.layer_type)
        out.update(layernorms=False, fusion_bias=config.fc_bias, transformer_layer_architecture=layer_class)
        state = {("fusion_fc." + key.removeprefix("fc.") if key.startswith("fc.")
                  else "transformer." + key.removeprefix("layers.0.")): value for key, value in state.items()}
    return state, out


def random_head(kind: str, target_config, seed: int = 0, draft_vocab_size: int = 0, medusa_heads: int = 4,
                aux_layers: tuple[int, ...] = (), norm_before_residual: bool = False, norm_before_fc: bool = False,
                layer_type: str = LLAMA, attention_bias: bool = False, num_layers: int = 1, mlp_stages: int = 4,
                tie_weights: bool = False, scale_input: bool = False
                ) -> EagleHead | MedusaHeads | MlpSpeculator:
    """A head of `kind` shaped for a transformers target config, with random weights (fixed seed): a head of
    no quality, which speculation must still keep lossless (tests), and where training starts."""
    text = target_config.get_text_config()
    raw = {key: getattr(text, key) for key in ("rope_theta", "max_position_embeddings") if hasattr(text, key)}
    if kind == MTP:  # (the model's config.json: its layers, its one MTP layer)
        raw.update(num_hidden_layers=text.num_hidden_layers, num_nextn_predict_layers=1)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if rope:
        raw["rope_scaling"] = dict(rope)
    config = HeadConfig(kind, text.hidden_size, text.vocab_size, draft_vocab_size=draft_vocab_size if kind == EAGLE3 else 0,
                        num_attention_heads=text.num_attention_heads,
                        num_key_value_heads=text.num_key_value_heads or text.num_attention_heads,
                        intermediate_size=text.intermediate_size, rms_norm_eps=text.rms_norm_eps,
                        aux_layers=tuple(aux_layers), medusa_heads=medusa_heads if kind == MEDUSA else 0,
                        medusa_layers=1 if kind == MEDUSA else 0, norm_before_residual=norm_before_residual,
                        norm_before_fc=norm_before_fc, layer_type=QWEN2 if kind == MTP else layer_type,
                        attention_bias=attention_bias and kind != MTP,
                        num_layers=num_layers if kind == EAGLE3 else 1, mlp_stages=mlp_stages if kind == MLP else 0,
                        inner_size=text.hidden_size if kind == MLP else 0, tie_weights=kind == MLP and tie_weights,
                        scale_input=kind == MLP and scale_input, raw=raw)
    torch.manual_seed(seed)
    head = {MEDUSA: MedusaHeads, MLP: MlpSpeculator}.get(kind, EagleHead)(config)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if "norm" not in name and not name.startswith("ln."):  # (an MLP speculator's norms: ln.)
                parameter.normal_(0.0, 0.5 / parameter.shape[-1] ** 0.5)
        if kind == EAGLE3 and head.lm_head.out_features < text.vocab_size:
            # The draft vocabulary: the first draft_vocab ids (training picks the most frequent instead).
            head.t2d.zero_()
            head.t2d[:head.lm_head.out_features] = True
    return head.eval()


def target_tensors(model) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers target's token embedding (V, h) and lm_head (V, h) weights: what a head attaches."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def check_fits(head: EagleHead | MedusaHeads, target_config, head_path: str, target_path: str) -> None:
    """Refuse a head made for another target, naming both: width, vocabulary, layer ids, d2t's range."""
    text = target_config.get_text_config()
    config = head.config
    problems = []
    target_width = config.target_hidden_size or config.hidden_size
    if target_width != text.hidden_size:
        problems.append(f"the head reads hidden size {target_width}, the target has {text.hidden_size}")
    if config.kind != EAGLE3 and config.hidden_size != text.hidden_size:
        problems.append(f"the head's hidden size {config.hidden_size} is not the target's {text.hidden_size}")
    if config.vocab_size != text.vocab_size:
        problems.append(f"the head's vocabulary has {config.vocab_size} tokens, the target's {text.vocab_size}")
    layers = config.feature_layers(text.num_hidden_layers)
    if any(not 0 <= layer < text.num_hidden_layers for layer in layers):
        problems.append(f"the head reads layers {list(layers)}, the target has {text.num_hidden_layers}")
    if config.kind == EAGLE3 and len(head.d2t):
        ids = head.draft_target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
            problems.append("its d2t maps draft tokens outside the target's vocabulary")
    if problems:
        raise HeadError(f"the draft head {head_path} does not fit the target {target_path}: {'; '.join(problems)}")


def read_target_tensors(target_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                        ) -> tuple[object, torch.Tensor, torch.Tensor]:
    """(config, embedding (V, h), lm_head (V, h)) of a transformers target directory in safetensors, read
    without loading the rest of its weights: what a head in a process of its own borrows (a copy)."""
    from safetensors import safe_open

    path = Path(target_path)
    if path.suffix == ".gguf" or not path.is_dir():
        raise HeadError(f"{path}: a draft head needs its target as a transformers directory in safetensors")
    config = llama_model.read_config(path)
    if isinstance(config, str):  # a target llama_model does not build: transformers reads its config
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    wanted = {"embed": ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"),
              "head": ("lm_head.weight",)}
    found: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).exists():
            raise HeadError(f"{path}: no {name} (a draft head reads the target's embedding from its safetensors)")
        with safe_open(str(path / name), framework="pt") as handle:
            keys = set(handle.keys())
            for role, candidates in wanted.items():
                for key in candidates:
                    if role not in found and key in keys:
                        found[role] = handle.get_tensor(key)
    if "embed" not in found:
        raise HeadError(f"{path}: no token embedding among its tensors")
    embed = found["embed"].to(device=device, dtype=dtype)
    head = found["head"].to(device=device, dtype=dtype) if "head" in found else embed  # tied embeddings
    return config, embed, head


def load_head_for(head_path: str | Path, target_path: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, target: tuple | None = None
                  ) -> tuple[EagleHead | MedusaHeads, object]:
    """(head, the target's config): a head ready to draft for its target, as draft_model and the benches
    load it: read, refused if it does not fit (HeadError naming both paths), the target's embedding (and
    EAGLE-1's lm_head) attached as copies in this process. target: (config, embedding, lm_head or None) of
    the target served in this process (`shared_target_tensors`), borrowed instead of read: a hosted head's
    (the lm_head read from target_path only where EAGLE-1 needs it and the target's is not borrowable)."""
    head = load_head(head_path, device, dtype)
    if target is None or (target[2] is None and reads_target_head(head)):
        target_config, embed, lm_head = read_target_tensors(target_path, device, dtype)
        if target is not None:  # the config and embedding still borrowed: the copy just read is dropped
            target_config, embed = target[:2]
    else:
        target_config, embed, lm_head = target
    check_fits(head, target_config, str(head_path), str(target_path))
    if hasattr(head, "attach"):
        head.attach(own_embedding(head, embed), lm_head)
    return head, target_config


def own_embedding(head: EagleHead, embed: torch.Tensor) -> torch.Tensor:
    """The token embedding the head drafts with: the target's `embed`, unless the head's file carries one of its
    shape that is not the target's at the file's precision (a head trained with its own embedding, as vLLM also
    takes it): that one, in `embed`'s dtype and device. The file's copy is let go either way."""
    own, head.file_embed = head.file_embed, None
    if own is None or own.shape != embed.shape or torch.equal(own, embed.detach().to(device="cpu", dtype=own.dtype)):
        return embed
    return own.to(device=embed.device, dtype=embed.dtype)


def reads_target_head(head: EagleHead | MedusaHeads) -> bool:
    """EAGLE-1 scores its drafts with the target's lm_head; EAGLE-3 and Medusa have their own."""
    return isinstance(head, EagleHead) and head.config.kind != EAGLE3


def shared_target_tensors(model, dtype: torch.dtype, device: torch.device | str) -> tuple | None:
    """(config, embedding (V, h), lm_head (V, h) or None) of a target model served in this process, for a
    hosted head to borrow rather than copy (a Llama-3 vocabulary's embedding is ~1 GB in bf16): the tensors
    themselves, where they are plain weights of the head's dtype on its device; the lm_head None where it is
    packed or quantized for the target's own kernels. None where the embedding cannot be borrowed."""
    device = torch.device(device)

    def plain(module, kind) -> torch.Tensor | None:
        weight = getattr(module, "weight", None)
        if type(module) is not kind or not isinstance(weight, torch.Tensor):
            return None
        if weight.dtype != dtype or weight.dim() != 2 or weight.device.type != device.type or (
                device.index is not None and weight.device.index != device.index):
            return None
        return weight.detach()

    embed = plain(model.get_input_embeddings(), nn.Embedding)
    if embed is None:
        return None
    return model.config, embed, plain(model.get_output_embeddings(), nn.Linear)


def borrowed(head: EagleHead | MedusaHeads, model) -> list[str]:
    """Which of a target model's weights the head holds as they are (the same memory), not as copies."""
    def same(tensor, module) -> bool:
        weight = getattr(module, "weight", None)
        return (tensor is not None and isinstance(weight, torch.Tensor) and weight.device == tensor.device
                and weight.data_ptr() == tensor.data_ptr())

    names = []
    if same(getattr(head, "embed", None), model.get_input_embeddings()):
        names.append("embedding")
    if reads_target_head(head) and same(head.target_head, model.get_output_embeddings()):
        names.append("lm_head")
    return names


def served_layers(head_paths: list[str], target_layers: int) -> tuple[int, ...]:
    """The target layers whose states target_model serves for these heads (the union, in the heads' order):
    target_model computes them at load, and each head's draft_model the same, to find its columns."""
    layers: list[int] = []
    for path in head_paths:
        config_file = Path(path) / "config.json"
        if not config_file.exists():
            raise HeadError(f"{path}: no config.json (a draft head directory holds config.json and its weights)")
        config = HeadConfig.from_json(json.loads(config_file.read_text()), path)
        layers += [layer for layer in config.feature_layers(target_layers) if layer not in layers]
    return tuple(layers)
