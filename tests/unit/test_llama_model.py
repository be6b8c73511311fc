"""llama_model.py: the Llama family's modules built from a model directory without transformers' model
classes hold transformers' weights and compute transformers' numbers; what it does not build it says why,
and the loader leaves to transformers."""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specdec.engine import llama_model
from specdec.engine.build import ExecutorConfig, build_executor, static_executor
from specdec.engine.loading import load_causal_lm
from specdec.engine.static_forward import StaticForward

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# (config class prefix, its settings): the families and the RoPE types built here
VARIANTS = {
    "llama": ("Llama", {}),
    "llama-tied-biases": ("Llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("Llama", {"rope_parameters": LLAMA3_ROPE}),
    "linear-rope": ("Llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "qwen2": ("Qwen2", {}),  # biases on the query/key/value projections
    "qwen3": ("Qwen3", {"head_dim": 8}),  # per-head RMSNorm of queries and keys
    "mistral": ("Mistral", {"sliding_window": None}),
}


def save_model(directory, prefix: str, dtype=torch.float32, **settings):
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, **settings)
    torch.manual_seed(0)
    getattr(transformers, f"{prefix}ForCausalLM")(config).to(dtype).save_pretrained(directory)
    return directory


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_built_model_is_transformers_model(tmp_path, variant):
    """Same tensors under the same names, the same rotary tables to the bit, the same static-executor
    logits to the bit (prompt, rollback, step), and a plain forward equal to transformers' own (float64)."""
    prefix, settings = VARIANTS[variant]
    path = save_model(tmp_path, prefix, **settings)
    own = llama_model.load(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert isinstance(own, llama_model.CausalLM) and own.config.model_type == theirs.config.model_type
    mine, reference = own.state_dict(), theirs.state_dict()
    assert set(mine) == {key for key in reference if "rotary_emb" not in key}
    assert all(torch.equal(mine[key], reference[key]) for key in mine)
    assert (own.lm_head.weight is own.model.embed_tokens.weight) == bool(settings.get("tie_word_embeddings"))
    positions = torch.arange(300)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for a, b in zip(own.model.rotary_emb(x, positions), theirs.model.rotary_emb(x, positions)):
        assert torch.equal(a, b), variant

    logits = []
    for model in (own, theirs):
        lm = static_executor(model, max_sequences=2, max_context=256, max_batch=2, max_rows=4, compile="off")
        logits.append([lm.extend(1, 0, [3, 5, 7, 9, 11, 13, 15], 3), lm.extend(1, 5, [4, 6], 2)])
    assert all(torch.equal(a, b) for a, b in zip(*logits)), variant

    own64, theirs64 = llama_model.load(path, torch.float64), theirs.to(torch.float64)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = own64(input_ids=ids, use_cache=False).logits, theirs64(input_ids=ids, use_cache=False).logits
    assert a.dtype == torch.float64 and torch.allclose(a, b, atol=1e-10), (variant, (a - b).abs().max())


def test_older_configs_rope_fields_are_read_as_transformers_reads_them(tmp_path):
    """rope_theta and rope_scaling at the top level (configs written before transformers 5)."""
    path = save_model(tmp_path, "Llama", rope_parameters=LLAMA3_ROPE)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (path / "config.json").write_text(json.dumps(config))
    own = llama_model.load(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert own.config.rope_parameters["rope_type"] == "llama3"
    positions = torch.arange(300)[None]
    x = torch.zeros(1)
    assert all(torch.equal(a, b) for a, b in zip(own.model.rotary_emb(x, positions),
                                                  theirs.model.rotary_emb(x, positions)))


def test_what_is_not_built_here_says_why_and_loads_through_transformers(tmp_path):
    cases = {
        "gpt2": "model type 'gpt2'",
        "sliding": "sliding-window attention",
        "yarn": "RoPE type 'yarn'",
        "quantized": "a quantized checkpoint",
        "gelu": "activation 'gelu'",
    }
    directory = tmp_path / "gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
                                 ).save_pretrained(directory)
    save_model(tmp_path / "sliding", "Mistral", sliding_window=16)
    save_model(tmp_path / "yarn", "Llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                            "original_max_position_embeddings": 128})
    save_model(tmp_path / "quantized", "Llama")
    edit_config(tmp_path / "quantized", quantization_config={"quant_method": "bitsandbytes"})
    save_model(tmp_path / "gelu", "Llama")
    edit_config(tmp_path / "gelu", hidden_act="gelu")
    for name, why in cases.items():
        assert llama_model.unsupported(tmp_path / name) == why, name
        with pytest.raises(ValueError, match=f"not built here: {why}"):
            llama_model.load(tmp_path / name)
    assert llama_model.unsupported(tmp_path / "nowhere") == "not a Hugging Face directory"
    model = load_causal_lm(str(tmp_path / "yarn"), own_modules=True, linear_kernels="torch")
    assert type(model).__name__ == "LlamaForCausalLM"  # transformers' own, RoPE and all
    assert type(load_causal_lm(str(tmp_path / "yarn"), linear_kernels="torch")).__name__ == "LlamaForCausalLM"


def test_weights_that_do_not_fit_the_config_are_refused_naming_them(tmp_path):
    path = save_model(tmp_path, "Llama")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected \['model.layers.0.extra.weight'\]"):
        llama_model.load(path)
    path = save_model(tmp_path / "narrow", "Llama")
    edit_config(path, intermediate_size=48)
    with pytest.raises(ValueError, match=r"wrong shape for its config: model.layers.0.mlp.gate_proj.weight \(64, 32\), not \(48, 32\)"):
        llama_model.load(path)


def test_a_served_model_loads_and_runs_without_transformers_modeling_stack(tmp_path):
    """What a target_model or draft_model process imports, loads and runs for the static executor: no
    transformers model code (and so neither torch._dynamo nor torch.distributed.tensor, which it pulls in)."""
    path = save_model(tmp_path, "Llama")
    script = f"""
import sys, torch
import specdec.triton.language_models
from specdec.engine.build import ExecutorConfig, build_executor, plans_static
from specdec.engine.loading import load_causal_lm
from specdec.engine.static_forward import StaticForward
own = plans_static("auto", "auto", "cpu", torch.float32)
model = load_causal_lm({str(path)!r}, own_modules=own)
lm = build_executor(model, ExecutorConfig(max_sequences=2, max_context=256))
lm.extend(1, 0, [3, 5, 7], 1)
heavy = [name for name in ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor")
         if name in sys.modules]
print(type(model).__name__, type(lm.forward).__name__, own, heavy)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    name, forward, own, heavy = result.stdout.split(maxsplit=3)
    if own == "False":  # the CPU kernels do not build here: the dynamic executor, transformers' model
        assert name == "LlamaForCausalLM" and forward == "TransformersForward"
        pytest.skip("the static executor does not run on this machine's CPU")
    assert (name, forward, heavy.strip()) == ("CausalLM", "StaticForward", "[]")


def test_the_executor_choice_before_a_model_exists_is_build_executors(tmp_path):
    """plans_static (what the adapter asks before loading) agrees with build_executor's choice."""
    from specdec.engine.build import plans_static

    path = save_model(tmp_path, "Llama")
    for executor in ("auto", "dynamic", "static"):
        planned = plans_static(executor, "auto", "cpu", torch.float32)
        model = load_causal_lm(str(path), own_modules=planned, linear_kernels="torch")
        built = build_executor(model, ExecutorConfig(executor=executor, max_sequences=2, max_context=256))
        assert isinstance(built.forward, StaticForward) == planned, executor
        assert isinstance(model, llama_model.CausalLM) == planned, executor


def test_a_heads_rotary_embedding_is_transformers(tmp_path):
    """draft_heads builds a head's rotary embedding here for the RoPE types llama_model computes, from the
    keys a head's config.json has (older or newer), else takes transformers' own."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specdec.engine.draft_heads import EAGLE3, HeadConfig, _rotary

    positions = torch.arange(400)[None]
    x = torch.zeros(1)
    for raw, kind in (({"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 256},
                       llama_model.RotaryEmbedding),
                      ({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}, llama_model.RotaryEmbedding),
                      ({}, llama_model.RotaryEmbedding),
                      ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 128},
                       LlamaRotaryEmbedding)):
        config = HeadConfig(EAGLE3, 32, 97, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            raw=raw)
        rotary = _rotary(config)
        reference = LlamaRotaryEmbedding(transformers.LlamaConfig(
            hidden_size=32, num_attention_heads=4, head_dim=config.head_dim,
            **({"rope_parameters": dict(raw.get("rope_parameters") or raw.get("rope_scaling"))}
               if raw.get("rope_parameters") or raw.get("rope_scaling") else {}),
            **{key: raw[key] for key in ("max_position_embeddings",) if key in raw}))
        assert isinstance(rotary, kind), raw
        assert all(torch.equal(a, b) for a, b in zip(rotary(x, positions), reference(x, positions))), raw
