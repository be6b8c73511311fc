"""A model's own MTP layer as its draft (MiMo: a Qwen2 model whose checkpoint holds `model.mtp_layers.0.*`):
the model served as its Qwen2 body with those tensors left out, the layer read alone from the checkpoint's shards,
its step against an independent reference on transformers' Qwen2 decoder layer (the target's state before its
final norm, as vLLM's MiMo MTP reads it), lossless speculation with it, and what cannot be read refused."""

import asyncio
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.engine import llama_model, loading
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.draft_heads import (MTP, MTP_PREFIX, HeadCache, HeadConfig, HeadError, load_head, load_head_for,
                                        random_head, save_head)
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.local import LocalProposer, LocalScorer
from tests.unit.test_draft_heads import PROMPT, reference_greedy

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False)


def _randomized(module, seed):
    """Every weight random, norms around 1 (not 1: the final norm's weight is what `from_target` undoes), each
    a float32 value (a head is made in float32, then converted, as a bfloat16 or float32 file is read)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            norm = "norm" in name
            parameter.copy_(((1.0 if norm else 0.0) + (0.3 if norm else 0.5 / parameter.shape[-1] ** 0.5)
                             * torch.randn(parameter.shape, generator=generator)).to(parameter.dtype))
    return module


def write_mimo(path: Path, model, head, max_shard_size: str = "5GB") -> Path:
    """A MiMo directory as its checkpoints are laid out: the Qwen2 `model`'s weights (in shards of
    `max_shard_size`), the MTP `head`'s layer in a shard of its own that the index maps (the head reading
    `model`'s final norm), MiMo's config.json naming its remote-code classes."""
    from safetensors import safe_open

    model.save_pretrained(path, max_shard_size=max_shard_size)
    head.target_norm.copy_(model.model.norm.weight)
    with tempfile.TemporaryDirectory() as made:
        layer = {key: value for key, value in load_file(str(save_head(head, made) / "model.safetensors")).items()
                 if key.startswith(MTP_PREFIX)}
        save_file(layer, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
    else:  # one file: an index naming it, as a sharded checkpoint's does
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            index = {"metadata": {}, "weight_map": {key: "model.safetensors" for key in handle.keys()}}
    index["weight_map"].update({key: "model-mtp.safetensors" for key in layer})
    index_file.write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1,
                  auto_map={"AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """A tiny MiMo directory in float64: Qwen2's weights in shards, its MTP layer in a shard of its own (as
    MiMo's index maps them), MiMo's config.json. -> (path, the Qwen2 model, the MTP head as made)."""
    torch.manual_seed(0)
    model = _randomized(Qwen2ForCausalLM(Qwen2Config(**SHAPE)).to(torch.float64), 1).eval()
    head = _randomized(random_head(MTP, model.config, seed=2).to(torch.float64), 3)
    path = write_mimo(tmp_path_factory.mktemp("mimo") / "MiMo-tiny", model, head, max_shard_size="40KB")
    return path, model, head


def mimo_reference(model, layer: dict, tokens: list[int]) -> torch.Tensor:
    """vLLM's MiMo MTP over a prompt's entries, on transformers' own Qwen2 modules: entry i reads the target's
    last state *before* its final norm at position i (a hook on that norm's input) and token i + 1's embedding
    (zero at position 0); input_proj over [hidden_layernorm(h) ‖ token_layernorm(e)], a Qwen2 decoder layer
    (causal), final_layernorm, the target's lm_head. -> logits (m, V)."""
    from transformers.models.qwen2 import modeling_qwen2

    config = Qwen2Config(**SHAPE)
    config._attn_implementation = "eager"
    captured = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: captured.append(args[0]))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    hook.remove()
    pre_norm = captured[0][0, :-1]  # (m, h): positions 0..m-1
    m = pre_norm.shape[0]

    def norm(name):
        module = modeling_qwen2.Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps).double()
        module.weight.data.copy_(layer[f"{MTP_PREFIX}{name}.weight"])
        return module

    block = modeling_qwen2.Qwen2DecoderLayer(config, 0).double()
    block.load_state_dict({key.removeprefix(MTP_PREFIX): value for key, value in layer.items()
                           if not key.removeprefix(MTP_PREFIX).startswith(
                               ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"))})
    embeds = model.model.embed_tokens.weight[tokens[1:]].clone()
    embeds[0] = 0
    x = torch.cat([norm("hidden_layernorm")(pre_norm), norm("token_layernorm")(embeds)], dim=-1)
    x = x @ layer[f"{MTP_PREFIX}input_proj.weight"].T
    cos, sin = modeling_qwen2.Qwen2RotaryEmbedding(config)(x[None], torch.arange(m)[None])
    mask = torch.full((m, m), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = block(x[None], attention_mask=mask, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    return norm("final_layernorm")(out[0]) @ model.lm_head.weight.T


def test_a_mimo_model_is_served_as_qwen2_without_its_mtp_layers(mimo):
    """The project's own modules and transformers' (Qwen2's: MiMo's classes are remote code) give Qwen2's logits."""
    path, model, _ = mimo
    assert llama_model.unsupported(path) is None
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = model(ids).logits
        own = llama_model.load(path, torch.float64)
        assert not any("mtp" in key for key in own.state_dict())
        torch.testing.assert_close(own(ids).logits, expected, rtol=1e-10, atol=1e-10)
        theirs = loading.load_causal_lm(str(path), dtype="float64", linear_kernels="torch")
        assert type(theirs).__name__ == "Qwen2ForCausalLM"
        torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-10, atol=1e-10)


def test_the_mtp_layer_drafts_as_mimos_mtp_computes(mimo):
    """Read alone from its shard (the target's embedding and lm_head attached), its rows over the target's
    post-norm states equal the reference's over the pre-norm ones; written back under MiMo's names."""
    path, model, made = mimo
    head, config = load_head_for(path, path, dtype=torch.float64)
    assert (head.config.kind, head.config.layer_type, config.model_type) == (MTP, "qwen2", "mimo")
    assert head.config.feature_layers(SHAPE["num_hidden_layers"]) == (SHAPE["num_hidden_layers"] - 1,)
    assert torch.equal(head.target_norm, model.model.norm.weight)
    assert all(torch.equal(head.state_dict()[key], value) for key, value in made.state_dict().items())
    layer = load_file(str(path / "model-mtp.safetensors"))
    expected = mimo_reference(model, layer, PROMPT)
    with torch.no_grad():
        post_norm = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0, :-1]
        _, logits = head(torch.tensor(PROMPT[1:]), head.from_target(post_norm), HeadCache(), 0)
        # the same rows one entry at a time over the head's cache, each next hidden the head's own output
        cache, rows = HeadCache(), []
        for i in range(len(PROMPT) - 1):
            _, row = head(torch.tensor(PROMPT[i + 1:i + 2]), head.from_target(post_norm[i:i + 1]), cache, i)
            rows.append(row)
    # equal up to float32 rounding: RMSNorm computes in float32 whatever the dtype (transformers' does too), and
    # the reference's hidden_layernorm normalizes h where the head rescales the final norm's output
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(rows), logits, rtol=1e-12, atol=1e-12)


def test_transformers_last_hidden_state_is_after_the_final_norm(mimo):
    """What `from_target` relies on: the feature the executors serve for the last layer is its post-norm state
    (transformers' hidden_states[-1]), the final norm's output."""
    _, model, _ = mimo
    captured = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        states = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    hook.remove()
    assert torch.equal(states[-1], captured[0])


@pytest.mark.parametrize("executor", ["dynamic", "static"])
def test_greedy_speculation_with_the_mtp_layer_equals_target_only(mimo, executor):
    path, _, _ = mimo
    # as served: the static executor over the project's own modules, the dynamic one over transformers' Qwen2
    qwen2 = loading.load_causal_lm(str(path), dtype="float64", linear_kernels="torch")
    target = llama_model.load(path, torch.float64) if executor == "static" else qwen2
    head, _ = load_head_for(path, path, dtype=torch.float64)
    layers = head.config.feature_layers(SHAPE["num_hidden_layers"])
    if executor == "dynamic":
        scorer = LocalScorer(dynamic_executor(target, hidden_layers=layers))
    else:
        scorer = LocalScorer(static_executor(target, kv_pool_tokens=512, block_size=8, max_context=128, max_batch=2,
                                             max_rows=6, min_window=16, compile="off", hidden_layers=layers))
    proposer = LocalProposer(HeadExecutor(head))
    expected = reference_greedy(qwen2, PROMPT, 24)
    for k in (1, 3):
        stats = Stats()

        async def run():
            rounds = generate(GenerationRequest(seq_id=k, prompt_ids=PROMPT, max_tokens=24), proposer, scorer,
                              DraftLengthPolicy.fixed(k), stats)
            return [t async for rnd in rounds for t in rnd.new_tokens]
        assert asyncio.run(run()) == expected
        assert stats.drafted >= k * (stats.rounds - 1 - k)
    assert not proposer.lm.sequences


def test_what_is_no_mtp_layer_here_is_refused_naming_it(mimo, tmp_path):
    path, _, _ = mimo
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(HeadError, match="model_type 'deepseek_v3'"):
        HeadConfig.from_json({**config, "model_type": "deepseek_v3"}, "ds")
    with pytest.raises(HeadError, match="a mimo model without MTP layers"):
        HeadConfig.from_json({**config, "num_nextn_predict_layers": 0}, "mimo-without")
    bare = tmp_path / "saved-without-mtp"  # a checkpoint saved through Qwen2's class drops the layer
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(SHAPE["hidden_size"])}, str(bare / "model.safetensors"))
    with pytest.raises(HeadError, match=r"hold no model\.mtp_layers\.0\.\* tensors"):
        load_head(bare)
    with pytest.raises(ValueError, match="speculators layout holds EAGLE heads"):
        save_head(load_head(path), tmp_path / "s", layout="speculators")
