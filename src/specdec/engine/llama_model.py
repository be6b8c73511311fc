"""The Llama family's modules, built from a Hugging Face directory without transformers' model classes.

The static executor's forward is this project's own (`llama_forward.py`): of a model it needs only the
weights, under transformers' module names, and the configuration. Importing transformers' modeling stack
costs a process about 2.8 s of CPU (torch.distributed.tensor, torch._dynamo and its quantizers, all pulled
in by `transformers.modeling_utils`), and Triton starts every model in a process of its own: each language
model's load, and each restart after a crash, paid it. So where the static executor will serve a model
(`build.plans_static`) and `unsupported` finds nothing it does not know, `loading.load_causal_lm` builds
the model here, from config.json and the safetensors files, and transformers' modeling stack is never
imported; anything else (other families, sliding windows, RoPE types other than `ROPE_TYPES`, GGUF, FP8
checkpoints, a model spread over GPUs, the eager executor) loads through transformers as before.

The modules compute what transformers' Llama modules compute (`RMSNorm`, `RotaryEmbedding` and `rotate`
are its math, op for op; tests/unit/test_llama_model.py holds them equal): `CausalLM.forward` is a plain
forward without a cache, what the linear-kernel timing (`onednn_linear.causal_lm_forward`) and the skip
search's agreement (`skip_layers.greedy_tokens`) run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from specdec.engine.llama_forward import FAMILY

ROPE_TYPES = ("default", "linear", "llama3")  # computed here; other RoPE types load through transformers
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # written by old checkpoints, computed at load
DRAFT_PREFIXES = ("model.mtp_layers.",)  # a checkpoint's MTP layers: a draft's (draft_heads), not the model's


class ModelConfig:
    """A model's config.json as transformers' config exposes it to the executor: the fields the forward
    reads, normalized (head_dim, num_key_value_heads, the RoPE parameters), every other field as written."""

    def __init__(self, raw: dict, rope: dict):
        self.raw = raw
        self.model_type = raw["model_type"]
        self.hidden_size = int(raw["hidden_size"])
        self.num_attention_heads = int(raw["num_attention_heads"])
        self.num_key_value_heads = int(raw.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim = int(raw.get("head_dim") or self.hidden_size // self.num_attention_heads)
        self.num_hidden_layers = int(raw["num_hidden_layers"])
        self.intermediate_size = int(raw["intermediate_size"])
        self.vocab_size = int(raw["vocab_size"])
        self.rms_norm_eps = float(raw.get("rms_norm_eps", 1e-6))  # every family's default
        self.hidden_act = raw.get("hidden_act", "silu")
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
        self.max_position_embeddings = raw.get("max_position_embeddings")
        self.rope_parameters = rope

    def __getattr__(self, name: str):
        # only reached for names not set above: config.json's other fields, else AttributeError as
        # transformers' config raises (callers use getattr with a default for optional fields)
        raw = self.__dict__.get("raw", {})
        if name in raw:
            return raw[name]
        raise AttributeError(name)

    def get_text_config(self) -> "ModelConfig":
        return self

    def to_dict(self) -> dict:
        return dict(self.raw)


def rope_parameters(raw: dict, default_theta: float | None = None) -> dict | str:
    """The RoPE parameters of a config.json (transformers 5's `rope_parameters`, or the older `rope_theta` and
    `rope_scaling`) as {"rope_type", "rope_theta", ...}, or why they are not computed here (a string)."""
    given = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(given, dict) or any(isinstance(value, dict) for value in given.values()):
        return "RoPE parameters per layer type"
    rope = dict(given)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    if rope["rope_type"] not in ROPE_TYPES:
        return f"RoPE type {rope['rope_type']!r}"
    if rope["rope_theta"] is None:
        return "no rope_theta"
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        return "a partial rotary factor"
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings",
                                                                    raw.get("max_position_embeddings")))
    return rope


def read_config(path: str | Path) -> ModelConfig | str:
    """The config of a model directory this module builds, or why it does not (a string)."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").exists():
        return "not a Hugging Face directory"
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") not in FAMILY:
        return f"model type {raw.get('model_type')!r}"
    if raw.get("quantization_config"):
        return "a quantized checkpoint"
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        return "sliding-window attention"
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {raw.get('hidden_act')!r}"
    if not _weight_files(path):
        return "no safetensors weights"
    rope = rope_parameters(raw)
    if isinstance(rope, str):
        return rope
    return ModelConfig(raw, rope)


def unsupported(path: str | Path) -> str | None:
    """None if `load` builds the model at `path`, else why not (transformers then loads it)."""
    config = read_config(path)
    return config if isinstance(config, str) else None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").exists() else []


def inverse_frequencies(head_dim: int, rope: dict) -> torch.Tensor:
    """(head_dim / 2,) float32: RoPE's inverse frequencies, as transformers computes them for the type."""
    base = rope["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":  # Llama 3.1: long wavelengths divided by the factor, a smooth ramp between
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        context = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = context / low, context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """forward(x, position_ids (B, N)) -> cos, sin (B, N, head_dim) in x's dtype."""

    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, rope), persistent=False)
        self.rope_type = rope["rope_type"]  # as transformers' module names it (none of ROPE_TYPES is dynamic)
        self.attention_scaling = 1.0  # ROPE_TYPES all leave cos and sin unscaled

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, heads, N, D), k (B, kv_heads, N, D), cos/sin (B, N, D): the rotary embedding applied."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, device=device))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, biases: set[str], qk_norm: bool, device):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.scaling = d ** -0.5
        self.q_proj = nn.Linear(h, self.heads * d, bias="q_proj" in biases, device=device)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias="k_proj" in biases, device=device)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias="v_proj" in biases, device=device)
        self.o_proj = nn.Linear(self.heads * d, h, bias="o_proj" in biases, device=device)
        if qk_norm:  # Qwen3: an RMSNorm over each head's queries and keys before the rotary embedding
            self.q_norm = RMSNorm(d, config.rms_norm_eps, device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, N, h): every row attends to itself and the rows before it."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out = scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=self.scaling,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, biases: set[str], device):
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias="gate_proj" in biases, device=device)
        self.up_proj = nn.Linear(h, m, bias="up_proj" in biases, device=device)
        self.down_proj = nn.Linear(m, h, bias="down_proj" in biases, device=device)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, biases: set[str], qk_norm: bool, device):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, biases, qk_norm, device)
        self.mlp = MLP(config, biases, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """transformers' `model.model`: the embedding, the decoder layers, the final norm, the rotary embedding."""

    def __init__(self, config: ModelConfig, biases: set[str], qk_norm: bool, device):
        super().__init__()
        self.config = config
        # given its (uninitialized) weight: nn.Embedding's random init would import torch._dynamo on "meta"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, device=device))
        self.layers = nn.ModuleList([DecoderLayer(config, i, biases, qk_norm, device)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_parameters)


class Output(NamedTuple):
    logits: torch.Tensor


class CausalLM(nn.Module):
    """The model as the executor reads it: `model.model` (Body), `lm_head`, `config`, as transformers names them."""

    def __init__(self, config: ModelConfig, biases: set[str] = frozenset(), qk_norm: bool = False,
                 device: torch.device | str | None = None):
        """device "meta": the modules without storage, for `load` to hand them the checkpoint's tensors."""
        super().__init__()
        self.config = config
        self.model = Body(config, biases, qk_norm, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, **unused) -> Output:
        """input_ids (B, N) -> logits (B, N, V): a plain forward over the layers now in `model.layers`,
        without a cache (`use_cache` and the like are accepted and ignored)."""
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        cos, sin = self.model.rotary_emb(x, positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return Output(self.lm_head(self.model.norm(x)))


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors from its safetensors, but those it does not use (IGNORED_TENSORS, DRAFT_PREFIXES):
    never read (a MiMo checkpoint's MTP layer stays on disk)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        if not file.exists():
            raise ValueError(f"{path}: {file.name} is missing")
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if not key.endswith(IGNORED_TENSORS) and not key.startswith(DRAFT_PREFIXES):
                    tensors[key] = handle.get_tensor(key)
    return tensors


@torch.no_grad()
def load(path: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The model at `path` (a directory `unsupported` accepts) on the CPU in `dtype`, its weights as stored
    converted to it, the embedding shared with lm_head where the config ties them (as transformers does,
    a stored lm_head.weight then unused). ValueError naming the tensors where they do not fit the config."""
    path = Path(path)
    config = read_config(path)
    if isinstance(config, str):
        raise ValueError(f"{path}: not built here: {config}")
    tensors = _read_tensors(path)
    biases = {key.split(".")[-2] for key in tensors if key.startswith("model.layers.0.") and key.endswith(".bias")}
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in tensors
    model = CausalLM(config, biases, qk_norm, device="meta")
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {key for key in model.state_dict() if not (config.tie_word_embeddings and key == "lm_head.weight")}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: the weights do not fit its config ({config.model_type}): missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    wrong = [key for key in shapes if key in tensors and tuple(tensors[key].shape) != shapes[key]]
    if wrong:
        raise ValueError(f"{path}: tensors of the wrong shape for its config: " + ", ".join(
            f"{key} {tuple(tensors[key].shape)}, not {shapes[key]}" for key in wrong[:5]))
    model.load_state_dict({key: value.to(dtype) for key, value in tensors.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()
