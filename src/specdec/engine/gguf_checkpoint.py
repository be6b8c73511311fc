"""A Llama-family GGUF checkpoint read straight into a Hugging Face model directory's two parts: its
config.json (a dict) and its weights (float32 tensors under transformers' names).

Why not transformers' own GGUF loading: it parses the file once for the config and again for the weights,
builds a name map by probing every architecture's table, and initialises a model at random before copying the
weights in; here one parse and numpy's dequantisation (half the default pair's conversion time, a third of a
served .gguf's load: docs/results/2026-12-04-suite-time.md). The result is the same bit for bit
(tests/unit/test_gguf_checkpoint.py checks it against transformers' loading of a file written with 4- and 8-bit
blocks and float32 tensors, q/k rows in llama.cpp's order).

Only `general.architecture: llama` (Llama 1-3, SmolLM, TinyLlama, Mistral's dense models as llama.cpp
writes them); any other architecture is refused naming it (transformers' loader reads those).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# llama.cpp's tensor names (without `.weight`) → transformers' Llama names; `blk.N.` → `model.layers.N.`
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


class UnsupportedGGUF(ValueError):
    pass


def read(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json's fields, {name: float32 tensor}) of a llama-architecture GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUF(f"{path}: GGUF architecture {arch!r} is not read here (only 'llama')")
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise UnsupportedGGUF(f"{path}: no token_embd.weight (not a language model's GGUF)")
    # (files older than llama.vocab_size have the vocabulary as the embedding's rows: its GGUF dims' last)
    config = _config(meta, has_output="output.weight" in shapes, vocab=shapes["token_embd.weight"][-1])
    weights = {}
    for tensor in reader.tensors:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        # numpy's shape is GGUF's dimensions reversed: (out_features, in_features) as torch keeps a linear's
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        name = _hf_name(tensor.name)
        if name.endswith("self_attn.q_proj.weight"):
            values = _unpermute(values, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            values = _unpermute(values, config["num_key_value_heads"])
        values = np.ascontiguousarray(values)
        weights[name] = torch.from_numpy(values if values.flags.writeable else values.copy())  # (F32: the file's map)
    return config, weights


def _hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in BLOCK_NAMES:
            raise UnsupportedGGUF(f"GGUF tensor {name!r} has no place in a Llama model")
        return f"model.layers.{int(layer)}.{BLOCK_NAMES[part]}.{kind}"
    if stem not in GLOBAL_NAMES:
        raise UnsupportedGGUF(f"GGUF tensor {name!r} has no place in a Llama model")
    return f"{GLOBAL_NAMES[stem]}.{kind}"


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which reorders each head's q/k rows from rotate-half pairs (i, i + d/2)
    to interleaved ones (2i, 2i + 1) for its RoPE: (heads·d, in) → the same shape, rows in Hugging Face's order."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _config(meta: dict, has_output: bool, vocab: int) -> dict:
    def get(key: str, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise UnsupportedGGUF(f"GGUF metadata has no llama.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "default"},
        "vocab_size": int(get("vocab_size", vocab)),
        "tie_word_embeddings": not has_output, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "dtype": "float32",
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"),
                      ("unk_token_id", "unknown")):
        token = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[key] = int(token)
    return config


def llama_config(config: dict):
    """transformers' LlamaConfig of `read`'s config fields."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hf_config.architectures = config["architectures"]
    return hf_config


def write_model_directory(config: dict, weights: dict[str, torch.Tensor], out: Path,
                          num_layers: int | None = None) -> None:
    """config.json, generation_config.json and model.safetensors in `out`, as transformers' save_pretrained
    writes them; `num_layers`: only the first layers (a layer-skip draft of the same weights)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if num_layers is not None:
        config = {**config, "num_hidden_layers": num_layers}
        weights = {name: tensor for name, tensor in weights.items()
                   if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    if config.get("tie_word_embeddings"):
        weights = {name: tensor for name, tensor in weights.items() if name != "lm_head.weight"}
    out.mkdir(parents=True, exist_ok=True)
    hf_config = llama_config(config)
    hf_config.save_pretrained(out)
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
