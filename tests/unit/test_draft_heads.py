"""Trained draft heads (EAGLE-1, EAGLE-3, Medusa): their files both ways, refusal of a head made for another
target, and speculation with heads of no quality staying lossless in process (greedy token for token,
sampling in distribution, the head's cache consistent after rejections)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.draft_heads import (EAGLE, EAGLE3, KINDS, MEDUSA, MLP, MTP, HeadCache, HeadConfig, HeadError,
                                        borrowed, check_fits, load_head, load_head_for, random_head, rows_forward,
                                        save_head, shared_target_tensors, target_tensors)
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.local import LocalProposer, LocalScorer
from tests.unit.conftest import run_fixed_k, run_fixed_k_many
from tests.unit.stats import chi_square_rejects

PROMPT = [5, 17, 3, 88, 41, 9, 60]
AUX = (0, 1, 1)  # EAGLE-3's layers on a 2-layer target (its default needs at least 4)
LAYERED = "eagle3-layers"  # an EAGLE-3 head of three decoder layers (the speculators library trains such)


def head_for(tiny_lm, kind, seed=0, **kwargs):
    if kind == LAYERED:
        kind, kwargs = EAGLE3, {"num_layers": 3, **kwargs}
    head = random_head(kind, tiny_lm.config, seed=seed, aux_layers=AUX if kind == EAGLE3 else (),
                       **({"draft_vocab_size": 64} if kind == EAGLE3 else {}), **kwargs).to(torch.float64)
    if hasattr(head, "attach"):  # (Medusa and MLP speculators read neither the embedding nor the lm_head)
        head.attach(*target_tensors(tiny_lm))
    return head


def pair(tiny_lm, kind, seed=0, executor="dynamic"):
    head = head_for(tiny_lm, kind, seed)
    layers = head.config.feature_layers(tiny_lm.config.num_hidden_layers)
    if executor == "dynamic":
        target = dynamic_executor(tiny_lm, hidden_layers=layers)
    else:
        target = static_executor(tiny_lm, kv_pool_tokens=512, block_size=8, max_context=128, max_batch=2,
                                 max_rows=6, min_window=16, compile="off", hidden_layers=layers)
    return LocalProposer(HeadExecutor(head)), LocalScorer(target)


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_written_is_read_back_with_the_published_key_names(tiny_lm, tmp_path, kind):
    head = head_for(tiny_lm, kind)
    save_head(head, tmp_path / kind)
    files = {EAGLE: "model.safetensors", EAGLE3: "model.safetensors", MEDUSA: "medusa_lm_head.safetensors",
             MLP: "model.safetensors", MTP: "model.safetensors"}
    keys = set(load_file(str(tmp_path / kind / files[kind])))
    published = {EAGLE: {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight",
                         "layers.0.post_attention_layernorm.weight"},
                 EAGLE3: {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                          "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"},
                 MEDUSA: {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "3.1.weight"},
                 MLP: {"emb.0.weight", "proj.0.weight", "proj.1.weight", "head.3.weight", "ln.3.weight",
                       "ln.3.bias"},
                 # MiMo's names (as vLLM's mimo_mtp loads them): the layer's own beside its Qwen2 decoder layer's
                 MTP: {"model.mtp_layers.0.token_layernorm.weight", "model.mtp_layers.0.hidden_layernorm.weight",
                       "model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.final_layernorm.weight",
                       "model.mtp_layers.0.self_attn.q_proj.bias", "model.mtp_layers.0.input_layernorm.weight",
                       "model.mtp_layers.0.mlp.down_proj.weight", "model.norm.weight"}}[kind]
    assert published <= keys
    # EAGLE-1 has no input norm; Qwen2's output projection no bias
    assert not any("input_layernorm" in key for key in keys) or kind in (EAGLE3, MTP)
    assert "model.mtp_layers.0.self_attn.o_proj.bias" not in keys
    config = json.loads((tmp_path / kind / "config.json").read_text())
    back = load_head(tmp_path / kind, dtype=torch.float64)
    assert back.config.kind == kind and back.config.feature_width == head.config.feature_width
    assert config.get("draft_vocab_size", 64) == 64
    for name, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


@pytest.mark.parametrize("kind", [EAGLE3, MEDUSA])
def test_vllm_renamed_keys_are_read_too(tiny_lm, tmp_path, kind):
    head = head_for(tiny_lm, kind)
    save_head(head, tmp_path / "published")
    name = "model.safetensors" if kind == EAGLE3 else "medusa_lm_head.safetensors"
    state = load_file(str(tmp_path / "published" / name))
    if kind == EAGLE3:  # vLLM: midlayer. -> layers.0.
        renamed = {key.replace("midlayer.", "layers.0."): value for key, value in state.items()}
    else:  # vLLM: {i}.{j}.linear.* -> blocks.{i}.layers.{j}.*, {i}.{L}.weight -> lm_heads.{i}.weight
        renamed = {}
        for key, value in state.items():
            parts = key.split(".")
            renamed[f"blocks.{parts[0]}.layers.{parts[1]}.{parts[3]}" if parts[2] == "linear"
                    else f"lm_heads.{parts[0]}.weight"] = value
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "config.json").write_text((tmp_path / "published" / "config.json").read_text())
    save_file(renamed, str(tmp_path / "vllm" / ("model.safetensors" if kind == EAGLE3 else "model.safetensors")))
    back = load_head(tmp_path / "vllm", dtype=torch.float64)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def speculators_eagle3(tiny_lm, path, head, **flags):
    """`head` written as the speculators library writes an EAGLE-3 head (vLLM loads that layout as it is): the
    decoder layer's settings as transformers' own `to_diff_dict` gives them, the layer ids as the states
    entering those layers (AUX, the outputs of layers 0, 1 and 1, are the states entering 1, 2 and 2), vLLM's
    key names, the target's embedding kept in the file; `flags` (norm_before_residual, norm_before_fc) too."""
    from transformers import LlamaConfig
    text = tiny_lm.config
    layer = LlamaConfig(vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_hidden_layers=1,
                        intermediate_size=text.intermediate_size, num_attention_heads=text.num_attention_heads,
                        num_key_value_heads=text.num_key_value_heads, rms_norm_eps=text.rms_norm_eps,
                        max_position_embeddings=text.max_position_embeddings, rope_parameters=text.rope_parameters)
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
              "draft_vocab_size": head.lm_head.out_features, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in AUX], **flags,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}},
              "transformer_layer_config": layer.to_diff_dict()}
    state = {key.replace("midlayer.", "layers.0."): value.contiguous() for key, value in head.state_dict().items()
             if not key.startswith("rotary.")}
    state["embed_tokens.weight"] = tiny_lm.get_input_embeddings().weight.detach().to(torch.float64).clone()
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return path


def first_row(state: dict, embed: torch.Tensor, token: int, features: torch.Tensor, heads: int, kv_heads: int,
              eps: float, norm_before_residual: bool, norm_before_fc: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's first entry of a fresh cache computed from its tensors, as the speculators library's
    layer does it: one key, so attention returns its value (no rotary embedding, no mask). -> (g' (h,), the
    logits over the draft vocabulary (V_d,))."""
    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean() + eps)

    g = state["fc.weight"] @ (rms(features, state["input_norm.weight"]) if norm_before_fc else features)
    normed = rms(g, state["layers.0.hidden_norm.weight"])
    x = torch.cat([rms(embed[token], state["layers.0.input_layernorm.weight"]), normed])
    v = (state["layers.0.self_attn.v_proj.weight"] @ x).view(kv_heads, -1)
    attn = state["layers.0.self_attn.o_proj.weight"] @ v.repeat_interleave(heads // kv_heads, 0).reshape(-1)
    x1 = (normed if norm_before_residual else g) + attn
    post = rms(x1, state["layers.0.post_attention_layernorm.weight"])
    gate, up = state["layers.0.mlp.gate_proj.weight"] @ post, state["layers.0.mlp.up_proj.weight"] @ post
    out = x1 + state["layers.0.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
    return out, state["lm_head.weight"] @ rms(out, state["norm.weight"])


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True}, {"norm_before_residual": True,
                                                                         "norm_before_fc": True}])
def test_a_head_in_the_speculators_layout_is_read_and_drafts_as_that_layout_defines(tiny_lm, tmp_path, flags):
    """RedHatAI's heads (vLLM serves them as they are): the layer's settings nested, the layer ids as the
    states entering those layers, norm_before_residual (the layer's residual normed) and norm_before_fc (an
    RMSNorm over the target's states); the head's first row equal to one computed from its tensors by the
    layout's definition, on torch's modules and on the CPU kernels, and speculation with it lossless."""
    from specdec.engine.head_kernels import HeadKernels
    head = head_for(tiny_lm, EAGLE3, seed=5)
    if flags.get("norm_before_fc"):
        head.input_norm = torch.nn.Module()
        head.input_norm.weight = torch.nn.Parameter(1 + torch.rand(head.config.feature_width, dtype=torch.float64))
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if "norm" in name:  # norms that are not the identity, so each one's place shows
                parameter.copy_(1 + torch.rand_like(parameter))
    path = speculators_eagle3(tiny_lm, tmp_path / "speculators", head, **flags)
    back = load_head(path, dtype=torch.float64)
    config = back.config
    assert (config.kind, config.aux_layers, config.draft_vocab_size) == (EAGLE3, AUX, 64)
    assert (config.norm_before_residual, config.norm_before_fc) == (bool(flags), "norm_before_fc" in flags)
    assert config.feature_layers(2) == AUX and config.head_dim == head.config.head_dim
    again = load_head(save_head(back, tmp_path / "published"), dtype=torch.float64)  # written as EAGLE's authors do
    assert (again.config.aux_layers, again.config.norm_before_residual, again.config.norm_before_fc) == (
        AUX, config.norm_before_residual, config.norm_before_fc)
    assert all(torch.equal(again.state_dict()[key], value) for key, value in back.state_dict().items())
    back.attach(*target_tensors(tiny_lm))
    back.to(torch.float64)
    state = load_file(str(path / "model.safetensors"))
    features = torch.randn(config.feature_width, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    out, draft = first_row(state, state["embed_tokens.weight"], PROMPT[0], features, config.num_attention_heads,
                           config.num_key_value_heads, config.rms_norm_eps, **{
                               "norm_before_residual": config.norm_before_residual,
                               "norm_before_fc": config.norm_before_fc})
    ids = back.draft_target_ids()
    with torch.no_grad():
        hidden = back.from_target(features[None])
        got, logits = back(torch.tensor(PROMPT[:1]), hidden, HeadCache(), 0)
        assert torch.allclose(got[0], out, atol=1e-10) and torch.allclose(logits[0, ids], draft, atol=1e-10)
    if flags:  # the CPU kernels' step (float32), the flags followed
        head32 = load_head(path)
        head32.attach(*(tensor.float() for tensor in target_tensors(tiny_lm)))
        kernels = HeadKernels.serving(head32)
        zero, one = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
        with torch.no_grad():  # the row sees the first entry (itself)
            got32, logits32 = kernels.step(torch.tensor(PROMPT[:1]), head32.from_target(features[None].float()),
                                           zero, HeadCache(), 0, one, zero)
        assert torch.allclose(got32[0].double(), out, atol=1e-4)
        assert torch.allclose(logits32[0, ids].double(), draft, atol=1e-4)
    proposer = LocalProposer(HeadExecutor(back))
    target = LocalScorer(dynamic_executor(tiny_lm, hidden_layers=AUX))
    stats = Stats()
    request = GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=16)
    assert run_fixed_k(request, proposer, target, 3, stats=stats) == reference_greedy(tiny_lm, PROMPT, 16)
    assert stats.drafted >= 3 * (stats.rounds - 4)


def transformers_reference(state: dict, embed: torch.Tensor, tokens: list[int], features: torch.Tensor, layer: dict,
                           norm_before_residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's first m entries of a fresh cache from its tensors, on transformers' own decoder layers of
    the type `layer` (its transformer_layer_config) names, as the speculators library builds a head: the first
    with 2h-wide query/key/value projections over [norm(embedding) ‖ hidden_norm(g)], the others (its
    num_hidden_layers) plain layers; causal attention over the m rows at positions 0..m-1.
    -> (g' (m, h), draft logits (m, V_d))."""
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    qwen3 = layer.get("model_type") == "qwen3"
    config = (Qwen3Config if qwen3 else LlamaConfig)(**layer)
    config._attn_implementation = "eager"
    modeling = modeling_qwen3 if qwen3 else modeling_llama
    decoder, rotary = ((modeling.Qwen3DecoderLayer, modeling.Qwen3RotaryEmbedding) if qwen3
                       else (modeling.LlamaDecoderLayer, modeling.LlamaRotaryEmbedding))
    modules = [decoder(config, i) for i in range(config.num_hidden_layers)]
    attn, h = modules[0].self_attn, config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * h, getattr(attn, name).out_features, bias=config.attention_bias))
    for i, module in enumerate(modules):
        module.load_state_dict({key.removeprefix(f"layers.{i}."): value for key, value in state.items()
                                if key.startswith(f"layers.{i}.") and "hidden_norm" not in key})
        module.double()

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    m, first = len(tokens), modules[0]
    g = features @ state["fc.weight"].T
    normed = rms(g, state["layers.0.hidden_norm.weight"])
    x = torch.cat([first.input_layernorm(embed[tokens]), normed], dim=-1)
    cos, sin = rotary(config)(x[None], torch.arange(m)[None])
    mask = torch.full((m, m), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    x1 = (normed if norm_before_residual else g) + attn(x[None], (cos, sin), mask)[0][0]
    out = x1 + first.mlp(first.post_attention_layernorm(x1))
    for module in modules[1:]:
        out = module(out[None], attention_mask=mask, position_embeddings=(cos, sin))[0]
    return out, rms(out, state["norm.weight"]) @ state["lm_head.weight"].T


@pytest.mark.parametrize("layer_type,layers", [("qwen3", 1), ("llama", 3), ("qwen3", 2)])
def test_a_head_of_qwen3_layers_or_of_several_drafts_as_transformers_layers_compute(tiny_lm, tmp_path, layer_type,
                                                                                   layers):
    """The speculators library trains a head for a Qwen3 target with Qwen3 decoder layers (per-head norms of
    the queries and keys before the rotary embedding, a head size of its own, biases where the config says),
    and heads of several layers (the first over 2h, plain ones after it): read, its rows equal to transformers'
    own layers' on torch's modules and on the CPU kernels, written back in both layouts the same, lossless."""
    from transformers import LlamaConfig, Qwen3Config

    from specdec.engine.draft_heads import QWEN3, EagleHead
    from specdec.engine.head_kernels import HeadKernels
    text = tiny_lm.config
    shape = dict(vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_hidden_layers=layers,
                 intermediate_size=text.intermediate_size, num_attention_heads=text.num_attention_heads,
                 num_key_value_heads=text.num_key_value_heads, rms_norm_eps=text.rms_norm_eps, attention_bias=True,
                 max_position_embeddings=text.max_position_embeddings)
    if layer_type == QWEN3:
        layer = Qwen3Config(**shape, head_dim=2 * text.hidden_size // text.num_attention_heads,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}).to_diff_dict()
    else:
        layer = LlamaConfig(**shape, mlp_bias=True, rope_parameters=text.rope_parameters).to_diff_dict()
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 64,
              "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in AUX],
              "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
              "transformer_layer_config": layer}
    made = EagleHead(HeadConfig.from_json(config, "made")).to(torch.float64)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in made.named_parameters():
            scale = 0.3 if "norm" in name else 0.5 / parameter.shape[-1] ** 0.5
            parameter.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(
                parameter.shape, dtype=torch.float64, generator=generator))
        made.t2d[:64] = True
    state = {key.replace("midlayer.", "layers.0."): value.contiguous() for key, value in made.state_dict().items()
             if not key.startswith("rotary.")}
    path = tmp_path / "qwen3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    back = load_head(path, dtype=torch.float64)
    assert (back.config.layer_type, back.config.attention_bias, back.config.num_layers) == (layer_type, True, layers)
    assert back.config.head_dim == made.config.head_dim and len(back.decoder_layers()) == layers
    assert all(hasattr(layer.self_attn, "k_norm") == (layer_type == QWEN3) and layer.self_attn.q_proj.bias is not None
               for layer in back.decoder_layers())
    assert back.config.mlp_bias == (layer_type == "llama")
    back.attach(*target_tensors(tiny_lm))
    embed = tiny_lm.get_input_embeddings().weight.detach()
    tokens = PROMPT[:5]
    features = torch.randn(5, back.config.feature_width, dtype=torch.float64, generator=generator)
    out, draft = transformers_reference(state, embed, tokens, features, layer, norm_before_residual=True)
    assert torch.isfinite(draft).all() and draft.std() > 1e-3
    ids = back.draft_target_ids()
    with torch.no_grad():
        got, logits = back(torch.tensor(tokens), back.from_target(features), HeadCache(), 0)
    torch.testing.assert_close(got, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits[:, ids], draft, rtol=1e-6, atol=1e-6)
    head32 = load_head(path)  # the CPU kernels (float32): row r sees entries 0..r
    head32.attach(*(tensor.float() for tensor in target_tensors(tiny_lm)))
    rows = torch.arange(5)
    with torch.no_grad():
        got32, logits32 = HeadKernels.serving(head32).step(
            torch.tensor(tokens), head32.from_target(features.float()), rows, HeadCache(), 0,
            torch.zeros(5, dtype=torch.long), (1 << (rows + 1)) - 1)
    torch.testing.assert_close(got32.double(), out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits32[:, ids].double(), draft, rtol=1e-4, atol=1e-4)
    for layout in ("eagle", "speculators"):
        written = json.loads((save_head(back, tmp_path / layout, layout=layout) / "config.json").read_text())
        nested = written.get("transformer_layer_config", written)
        assert (nested["model_type"], nested["num_hidden_layers"], nested["attention_bias"]) == (
            layer_type, layers, True)
        (Qwen3Config if layer_type == QWEN3 else LlamaConfig)(**nested)  # what the library builds the layers from
        names = load_file(str(tmp_path / layout / "model.safetensors")).keys()
        held = {key.split(".")[1] for key in names if key.startswith("layers.")}
        midlayer = any(key.startswith("midlayer.") for key in names)  # EAGLE's name of the first
        assert (held, midlayer) == (({str(i) for i in range(layers)}, False) if layout == "speculators"
                                    else ({str(i) for i in range(1, layers)}, True))
        again = load_head(tmp_path / layout, dtype=torch.float64)
        assert (again.config.layer_type, again.config.num_layers) == (layer_type, layers)
        assert all(torch.equal(again.state_dict()[key], value) for key, value in back.state_dict().items())
    # EAGLE's own layout names a Llama layer by its architecture whatever model_type it copied from its target
    flat = {**back.config.to_json(), "architectures": ["LlamaForCausalLMEagle3"]}
    assert HeadConfig.from_json(flat, "flat").layer_type == "llama"
    proposer = LocalProposer(HeadExecutor(back))
    target = LocalScorer(dynamic_executor(tiny_lm, hidden_layers=AUX))
    request = GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=16)
    assert run_fixed_k(request, proposer, target, 3) == reference_greedy(tiny_lm, PROMPT, 16)


def test_the_speculators_layouts_eagle1_is_read_and_what_it_cannot_be_is_refused(tiny_lm, tmp_path):
    """EAGLE-1 (and HASS) in the speculators layout: fusion_fc and transformer keys, `fusion_bias`; refused by
    name: its `layernorms` variant, other kinds, another layer type, weights of more layers than the config
    says, the embeddings' id."""
    head = head_for(tiny_lm, EAGLE)
    renamed = {("fusion_fc." + key[3:] if key.startswith("fc.") else "transformer." + key[9:]): value.contiguous()
               for key, value in head.state_dict().items() if not key.startswith("rotary.")}
    renamed["lm_head.weight"] = tiny_lm.get_output_embeddings().weight.detach().clone()  # the verifier's, unused
    layer = {key: value for key, value in head.config.to_json().items() if key != "architectures"}
    config = {"speculators_model_type": "eagle", "layernorms": False, "fusion_bias": False,
              "transformer_layer_config": {**layer, "num_hidden_layers": 32}}
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text(json.dumps(config))
    save_file(renamed, str(tmp_path / "eagle" / "model.safetensors"))
    back = load_head(tmp_path / "eagle", dtype=torch.float64)
    assert back.config.kind == EAGLE and not back.config.fc_bias
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    refused = [({**config, "layernorms": True}, "an EAGLE head with `layernorms`"),
               ({**config, "speculators_model_type": "mlp"}, "speculators_model_type 'mlp'"),
               ({**config, "transformer_layer_config": {**layer, "model_type": "gemma2"}}, "model_type 'gemma2'"),
               ({**config, "transformer_layer_architecture": "MistralDecoderLayer"}, "'MistralDecoderLayer'"),
               ({**config, "transformer_layer_config": {**layer, "hidden_act": "gelu"}}, "hidden_act 'gelu'")]
    # the layer's class, where the config names one, is the layer (speculators builds its EAGLE-1 layer from it)
    for named, layer_type in [("LlamaDecoderLayer", "llama"), ("Qwen3DecoderLayer", "qwen3"), ("auto", "llama")]:
        assert HeadConfig.from_json({**config, "transformer_layer_architecture": named}, "c").layer_type == layer_type
    for bad, message in refused:
        (tmp_path / "eagle" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(HeadError, match=message):
            load_head(tmp_path / "eagle")
    three = speculators_eagle3(tiny_lm, tmp_path / "three", head_for(tiny_lm, EAGLE3))
    state = load_file(str(three / "model.safetensors"))
    save_file({**state, "layers.1.mlp.up_proj.weight": state["layers.0.mlp.up_proj.weight"].clone()},
              str(three / "model.safetensors"))
    with pytest.raises(HeadError, match="its weights hold 2 decoder layers, its config.json's num_hidden_layers"):
        load_head(three)
    config = json.loads((three / "config.json").read_text())
    (three / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}))
    with pytest.raises(HeadError, match=r"the embeddings \(id 0\)"):
        load_head(three)


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_a_head_written_in_the_speculators_layout_has_its_names_and_is_read_back(tiny_lm, tmp_path, kind):
    """What vLLM serves as it is: speculators_model_type, the layer's settings a transformers LlamaConfig, the
    layer ids as the states entering the next layers, layers.0 (EAGLE-3) or fusion_fc / transformer keys."""
    from transformers import LlamaConfig
    head = head_for(tiny_lm, kind, **({"norm_before_residual": True} if kind == EAGLE3 else {}))
    save_head(head, tmp_path / "h", layout="speculators", verifier="/models/target", speculative_tokens=4)
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    keys = set(load_file(str(tmp_path / "h" / "model.safetensors")))
    assert config["speculators_model_type"] == kind
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = LlamaConfig(**config["transformer_layer_config"])
    assert (layer.hidden_size, layer.head_dim, layer.num_key_value_heads, layer.num_hidden_layers) == (
        head.config.hidden_size, head.config.head_dim, head.config.num_key_value_heads, 1)
    if kind == EAGLE3:
        assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in AUX] and config["norm_before_residual"]
        assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "d2t", "t2d",
                "lm_head.weight", "norm.weight"} <= keys and not any(key.startswith("midlayer.") for key in keys)
    else:
        assert {"fusion_fc.weight", "transformer.self_attn.q_proj.weight", "transformer.mlp.up_proj.weight"} <= keys
        assert not config["layernorms"] and not any(key.startswith(("fc.", "layers.")) for key in keys)
        assert config["transformer_layer_architecture"] == "LlamaDecoderLayer"
    back = load_head(tmp_path / "h", dtype=torch.float64)
    assert (back.config.aux_layers, back.config.norm_before_residual) == (head.config.aux_layers,
                                                                         head.config.norm_before_residual)
    assert all(torch.equal(back.state_dict()[key], value) for key, value in head.state_dict().items())
    with pytest.raises(ValueError, match="the speculators layout holds EAGLE heads"):
        save_head(head_for(tiny_lm, MEDUSA), tmp_path / "m", layout="speculators")


def test_a_head_drafts_with_the_embedding_its_file_carries_only_where_it_is_not_the_targets(tiny_lm, tmp_path):
    """The speculators layout (and EAGLE-1's) keeps an embedding in the file: the target's, borrowed then, or
    one the head trained (embed_requires_grad), which it must draft with."""
    target_dir = tmp_path / "target"
    tiny_lm.save_pretrained(target_dir, safe_serialization=True)
    embed = tiny_lm.get_input_embeddings().weight.detach()
    head = head_for(tiny_lm, EAGLE3, seed=7)
    trained = embed + 0.5 * torch.randn(embed.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    features = torch.randn(1, head.config.feature_width, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(9))
    drafted = {}
    for name, file_embed in (("same", embed), ("own", trained), ("none", None)):
        path = speculators_eagle3(tiny_lm, tmp_path / name, head)
        state = load_file(str(path / "model.safetensors"))
        if file_embed is None:
            del state["embed_tokens.weight"]
        else:
            state["embed_tokens.weight"] = file_embed.clone()
        save_file(state, str(path / "model.safetensors"))
        loaded, _ = load_head_for(path, target_dir, dtype=torch.float64)
        assert loaded.file_embed is None  # let go
        assert torch.equal(loaded.embed, trained if name == "own" else embed)
        with torch.no_grad():
            drafted[name] = loaded(torch.tensor(PROMPT[:1]), loaded.from_target(features), HeadCache(), 0)[1]
    assert torch.equal(drafted["same"], drafted["none"]) and not torch.equal(drafted["same"], drafted["own"])


def test_d2t_and_t2d_may_be_left_out_only_where_the_draft_vocabulary_is_the_targets(tiny_lm, tmp_path):
    for draft_vocab, fits in ((0, True), (64, False)):  # 0: the whole vocabulary
        head = random_head(EAGLE3, tiny_lm.config, aux_layers=AUX, draft_vocab_size=draft_vocab)
        save_head(head, tmp_path / str(draft_vocab), layout="speculators")
        state = load_file(str(tmp_path / str(draft_vocab) / "model.safetensors"))
        save_file({key: value for key, value in state.items() if key not in ("d2t", "t2d")},
                  str(tmp_path / str(draft_vocab) / "model.safetensors"))
        if fits:
            back = load_head(tmp_path / str(draft_vocab))
            assert bool(back.t2d.all()) and torch.equal(back.draft_target_ids(), torch.arange(97))
        else:
            with pytest.raises(HeadError, match=r"missing \['d2t', 't2d'\]"):
                load_head(tmp_path / str(draft_vocab))


def test_layer_ids_outside_the_speculators_layout_are_the_outputs_of_those_layers():
    """ModelOpt's export (NVIDIA's heads) writes the ids of the layers whose outputs it trained on, nested in
    eagle_config or at the top; the speculators layout the layers those states enter."""
    base = {"hidden_size": 32, "vocab_size": 97, "num_attention_heads": 4, "intermediate_size": 64,
            "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64}
    for raw in ({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}},
                {**base, "eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
                {"speculators_model_type": "eagle3", "draft_vocab_size": 64, "transformer_layer_config": base,
                 "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}):
        config = HeadConfig.from_json(raw, "/heads/h")
        assert config.aux_layers == (1, 29, 57) and config.feature_layers(61) == (1, 29, 57)
        assert HeadConfig.from_json(config.to_json(), "/again").aux_layers == (1, 29, 57)


def _ibm_stages(state: dict, config, feature, tokens):
    """An MLP speculator's logits (S, m, V) recomputed from its tensors by the paper's formula (fms-extras'
    stages, vLLM's mlp_speculator): s = GELU(LN_j(proj_j s + sqrt((1 - a^2) d / 2) / a emb_j x)), a = 0.5^(0.5/n),
    LN an RMS norm (no mean taken out) with weight and bias; s_0 the feature (rms-normed / sqrt(2) with
    scale_input)."""
    def rms(x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    n, d = config.mlp_stages, config.inner_size
    a = 0.5 ** (0.5 / n)
    scale = ((1 - a * a) * d / 2) ** 0.5 / a
    s = rms(feature) / 2 ** 0.5 if config.scale_input else feature
    out = []
    for j in range(tokens.shape[1]):
        tied = config.tie_weights
        emb, norm = ("emb.0", "ln.0") if tied else (f"emb.{j}", f"ln.{j}")
        proj = f"proj.{min(j, 1)}" if tied else f"proj.{j}"
        mixed = s @ state[proj + ".weight"].T + scale * state[emb + ".weight"][tokens[:, j]]
        s = torch.nn.functional.gelu(rms(mixed) * state[norm + ".weight"] + state[norm + ".bias"])
        out.append(s @ state[f"head.{j}.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("tied", [False, True])
def test_an_mlp_speculator_is_read_in_ibms_layout_and_computes_its_stages(tiny_lm, tmp_path, tied):
    """IBM's MLP speculators (vLLM's mlp_speculator): config (emb_dim, inner_dim, n_predict, tie_weights,
    scale_input), keys emb/proj/head/ln.{j} (a tied tensor held once, as vLLM names it; fms-extras'
    `speculator.` prefix read too); logits equal to the paper's formula recomputed from the tensors; a
    speculator for another width or vocabulary refused naming both; vLLM's config read as a head."""
    from specdec.serving.speculative_config import read as read_speculative
    head = random_head(MLP, tiny_lm.config, seed=5, mlp_stages=3, tie_weights=tied, scale_input=tied).double()
    with torch.no_grad():  # norms away from their start (ones, zeros): a skipped weight or bias shows
        for name, parameter in head.named_parameters():
            if name.startswith("ln."):  # (values a float32 module, as load_head builds one, holds exactly)
                low = 0.5 if name.endswith("weight") else -0.3
                parameter.copy_(torch.rand(parameter.shape, generator=torch.Generator().manual_seed(3)) * 0.6 + low)
    save_head(head, tmp_path / "mlp")
    keys = set(load_file(str(tmp_path / "mlp" / "model.safetensors")))
    assert ("emb.1.weight" in keys) != tied and ("proj.2.weight" in keys) != tied and "head.2.weight" in keys
    config = json.loads((tmp_path / "mlp" / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["n_predict"] == 3 and config["emb_dim"] == 32
    weights = str(tmp_path / "mlp" / "model.safetensors")
    save_file({f"speculator.{key}": value for key, value in load_file(weights).items()}, weights)
    back = load_head(tmp_path / "mlp", dtype=torch.float64)
    features = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 97, (4, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = _ibm_stages(head.state_dict(), head.config, features, tokens)
        assert torch.allclose(back(features, tokens), expected, atol=1e-10)
        # drafting: stage by stage over its own tokens, as the reference reads them
        drafted = HeadExecutor(back).propose(1, 0, PROMPT, 3, SamplingParams(), features=features)
        path = torch.tensor([[PROMPT[-1], *drafted.tokens[:2]]])
        stages = _ibm_stages(head.state_dict(), head.config, features[-1:], path)
        assert drafted.tokens == stages[:, 0].argmax(-1).tolist()
    check_fits(back, tiny_lm.config, "/heads/m", "/models/t")
    assert "no cache" in HeadExecutor(back).forward.summary(0, 0.0)  # what draft_model's log says of it
    from transformers import LlamaConfig
    other = LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(HeadError, match=r"/heads/m does not fit the target /models/t: .*hidden size 32.*"
                                        r"vocabulary has 97"):
        check_fits(back, other, "/heads/m", "/models/t")
    assert read_speculative(json.dumps({"model": str(tmp_path / "mlp"), "num_speculative_tokens": 3})).head
    assert read_speculative(json.dumps({"method": "mlp_speculator", "model": str(tmp_path / "mlp"),
                                        "num_speculative_tokens": 3})).head == str(tmp_path / "mlp")
    with pytest.raises(HeadError, match="n_predict 1"):
        HeadConfig.from_json({**config, "n_predict": 1, "tie_weights": True}, "/heads/m")


def test_heads_that_do_not_fit_are_refused_naming_both(tiny_lm, tmp_path):
    from transformers import LlamaConfig
    other = LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    head = random_head(EAGLE3, other, aux_layers=(0, 1, 5))
    with pytest.raises(HeadError, match=r"the draft head /heads/h does not fit the target /models/t: .*hidden size 48.*"
                                        r"vocabulary has 120.*layers \[0, 1, 5\]"):
        check_fits(head, tiny_lm.config, "/heads/h", "/models/t")
    check_fits(head_for(tiny_lm, EAGLE3), tiny_lm.config, "/heads/h", "/models/t")  # a fitting one passes
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "vocab_size": 97, "num_attention_heads": 4,
                                                      "intermediate_size": 64}))
    with pytest.raises(HeadError, match="no head weights"):
        load_head(tmp_path)
    save_file({"fc.weight": torch.zeros(32, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadError, match="not a eagle head's weights: missing"):
        load_head(tmp_path)


def test_load_head_for_checks_the_head_against_its_target_and_attaches_the_targets_tensors(tiny_lm, tmp_path):
    """What draft_model and the benches load: the saved head, refused by name when made for another target,
    else drafting with the target's own embedding (a copy read from its safetensors)."""
    from transformers import LlamaConfig
    tiny_lm.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_head(head_for(tiny_lm, EAGLE), tmp_path / "fits")
    other = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    save_head(random_head(EAGLE, other), tmp_path / "other")
    with pytest.raises(HeadError, match=f"{tmp_path / 'other'} does not fit the target {tmp_path / 'target'}"):
        load_head_for(tmp_path / "other", tmp_path / "target", dtype=torch.float64)
    head, config = load_head_for(tmp_path / "fits", tmp_path / "target", dtype=torch.float64)
    assert config.vocab_size == tiny_lm.config.vocab_size
    assert torch.equal(head.embed, tiny_lm.get_input_embeddings().weight.to(torch.float64))


def test_a_hosted_head_borrows_the_targets_tensors_instead_of_copying_them(tiny_lm, tmp_path):
    """A head hosted in the target's process (target_model's hosted_heads) holds the served target's embedding,
    and EAGLE-1 its lm_head, as they are: the same memory, no copy; an lm_head the target packed for its own
    kernels (not a plain nn.Linear), or weights of another dtype, are not borrowed. It drafts the same."""
    import copy
    tiny_lm.save_pretrained(tmp_path / "target", safe_serialization=True)
    for kind in (EAGLE, EAGLE3):
        save_head(head_for(tiny_lm, kind), tmp_path / kind)
    dtype = tiny_lm.dtype
    assert shared_target_tensors(tiny_lm, torch.float16, "cpu") is None
    packed = copy.deepcopy(tiny_lm)
    packed.lm_head = torch.nn.Sequential(packed.lm_head)  # what a packed or quantized lm_head looks like here
    tokens = torch.tensor([3, 9, 27])
    for model, kind, expected in [(tiny_lm, EAGLE, ["embedding", "lm_head"]), (tiny_lm, EAGLE3, ["embedding"]),
                                  (packed, EAGLE, ["embedding"])]:
        target = shared_target_tensors(model, dtype, "cpu")
        head, config = load_head_for(tmp_path / kind, tmp_path / "target", dtype=dtype, target=target)
        copied, _ = load_head_for(tmp_path / kind, tmp_path / "target", dtype=dtype)
        assert borrowed(head, model) == expected and borrowed(copied, model) == []
        assert config is model.config
        hidden = torch.randn(3, head.config.feature_width if kind == EAGLE3 else head.config.hidden_size,
                             generator=torch.Generator().manual_seed(1), dtype=dtype)
        with torch.no_grad():
            ours = head(tokens, head.from_target(hidden), HeadCache(), 0)
            theirs = copied(tokens, copied.from_target(hidden), HeadCache(), 0)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def reference_greedy(tiny_lm, prompt, n):
    return run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=n), NgramProposer(),
                       LocalScorer(dynamic_executor(tiny_lm)), 0)


@pytest.mark.parametrize("executor", ["dynamic", "static"])
@pytest.mark.parametrize("kind", [*KINDS, LAYERED])
def test_greedy_speculation_with_a_random_head_equals_target_only(tiny_lm, kind, executor):
    expected = reference_greedy(tiny_lm, PROMPT, 24)
    proposer, scorer = pair(tiny_lm, kind, executor=executor)
    for k in (1, 3):
        stats = Stats()

        async def run():
            rounds = generate(GenerationRequest(seq_id=7 + k, prompt_ids=PROMPT, max_tokens=24), proposer, scorer,
                              DraftLengthPolicy.fixed(k), stats)
            return [t async for rnd in rounds for t in rnd.new_tokens]
        import asyncio
        assert asyncio.run(run()) == expected
        # The head drafts every round after the first (the last ones: up to the tokens left)
        assert stats.drafted >= k * (stats.rounds - 1 - k)
    assert not proposer.lm.sequences  # released at the end


@pytest.mark.parametrize("executor", ["dynamic", "static"])
def test_a_heads_first_round_scores_the_prompt_and_drafts_on(tiny_lm, executor):
    """prompt_log_probs with a head: the first round's features are every prompt row's, the prompt's scores
    the target's, and the generation the one target-only decoding gives."""
    import asyncio

    proposer, scorer = pair(tiny_lm, EAGLE3, executor=executor)

    async def run():
        req = GenerationRequest(seq_id=21, prompt_ids=PROMPT, max_tokens=16, prompt_log_probs=True)
        return [rnd async for rnd in generate(req, proposer, scorer, DraftLengthPolicy.fixed(3))]
    rounds = asyncio.run(run())
    assert [t for rnd in rounds for t in rnd.new_tokens] == reference_greedy(tiny_lm, PROMPT, 16)
    assert sum(rnd.num_drafted for rnd in rounds[1:]) > 0
    with torch.no_grad():
        rows = torch.log_softmax(tiny_lm(torch.tensor([PROMPT])).logits[0, :-1].double(), -1)
    assert torch.allclose(torch.tensor(rounds[0].prompt_log_probs, dtype=torch.float64),
                          rows[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])], atol=1e-6)


def test_a_head_that_copies_the_target_is_accepted_and_its_cache_matches_a_fresh_run(tiny_lm):
    """A Medusa head whose first head is the target's own lm_head drafts the target's next-next token only
    by luck; an EAGLE-1 head is checked differently: after a generation with rejections its cache entries
    equal one pass of the head over the same features (rollback leaves no stale entry)."""
    head = head_for(tiny_lm, EAGLE)
    layers = head.config.feature_layers(2)
    target = dynamic_executor(tiny_lm, hidden_layers=layers)
    executor = HeadExecutor(head)
    proposer = LocalProposer(executor)
    stats = Stats()

    async def run():
        rounds = generate(GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=20), proposer,
                          LocalScorer(target), DraftLengthPolicy.fixed(3), stats)
        tokens = []
        async for rnd in rounds:
            tokens += rnd.new_tokens
            if len(tokens) >= 19:
                cache = executor.sequences[3].cache
                return tokens, cache.keys[:, :cache.length].clone(), cache.length
    import asyncio
    tokens, keys, entries = asyncio.run(run())
    assert stats.drafted > stats.accepted  # rejections happened
    # One pass: the target's features over prompt + output, the head over all entries at once.
    ids = PROMPT + tokens
    with torch.no_grad():
        hidden = tiny_lm(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    fresh = HeadCache()
    with torch.no_grad():
        head(torch.tensor(ids[1:entries + 1]), hidden[:entries], fresh, 0)
    assert torch.allclose(keys, fresh.keys[:, :entries], atol=1e-9)


def _marginals(tiny_lm, prompt, temperature):
    """The target's exact distributions of generated tokens 2 and 3, sampled at `temperature`."""
    def softmax(logits):
        return torch.softmax(logits.double() / temperature, -1)
    with torch.no_grad():
        p1 = softmax(tiny_lm(torch.tensor([prompt])).logits[0, -1])
        vocab = len(p1)
        ids = torch.tensor([prompt + [t] for t in range(vocab)])
        p2_given = softmax(tiny_lm(ids).logits[:, -1])  # (t1, t2)
        p2 = p1 @ p2_given
        joint12 = p1[:, None] * p2_given
        pairs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3_given = torch.cat([softmax(tiny_lm(chunk).logits[:, -1])
                              for chunk in pairs.split(2048)])
        p3 = joint12.reshape(-1) @ p3_given
    return p2, p3


@pytest.mark.parametrize("kind", [EAGLE3, MEDUSA, MLP])
def test_sampled_speculation_with_a_head_follows_the_targets_distribution(tiny_lm, kind):
    """Tokens 2 and 3 (the first round a head drafts in) against the target's exact marginals."""
    temperature = 0.6
    p2, p3 = _marginals(tiny_lm, PROMPT, temperature)
    proposer, scorer = pair(tiny_lm, kind, seed=3)
    n = 400
    counts = torch.zeros(2, len(p2), dtype=torch.float64)
    requests = [GenerationRequest(seq_id=100 + seed, prompt_ids=PROMPT, max_tokens=4,
                                  sampling=SamplingParams(temperature=temperature, seed=seed)) for seed in range(n)]
    for out in run_fixed_k_many(requests, proposer, scorer, 2):
        counts[0, out[1]] += 1
        counts[1, out[2]] += 1
    assert not chi_square_rejects(counts[0], p2) and not chi_square_rejects(counts[1], p3)


def _draws_greedily(drafted):
    """Planted bug: the most likely token drafted, the distribution reported as if it had been sampled."""
    return type(drafted)(drafted.probs.argmax(-1).tolist(), drafted.probs, drafted.cached_length)


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3, MEDUSA, MLP, "planted"])
def test_a_sampling_head_draws_from_the_distributions_it_reports(tiny_lm, kind):
    """What rejection sampling's exactness rests on (its own joint test: test_rejection_sampler.py): each
    drafted token comes from the distribution reported with it. The first and second drafted tokens of
    one state, over many seeds, against the reported rows (the second given the first: the most frequent
    first token's draws); a head drafting its argmax fails."""
    head = head_for(tiny_lm, EAGLE if kind == "planted" else kind, seed=3)
    executor = HeadExecutor(head)
    layers = head.config.feature_layers(2)
    with torch.no_grad():
        out = tiny_lm(torch.tensor([PROMPT]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[layer + 1][0] for layer in layers], dim=-1)[:-1]
    params = SamplingParams(temperature=0.8)
    firsts, seconds, rows = [], {}, {}
    for seed in range(1500):
        drafted = executor.propose(1, 0, PROMPT, 2, params, torch.Generator().manual_seed(seed), features=features)
        if kind == "planted":
            drafted = _draws_greedily(drafted)
        executor.release(1)
        firsts.append(drafted.tokens[0])
        rows.setdefault("first", drafted.probs[0])
        seconds.setdefault(drafted.tokens[0], []).append(drafted.tokens[1])
        rows.setdefault(drafted.tokens[0], drafted.probs[1])
    counts = torch.bincount(torch.tensor(firsts), minlength=97).double()
    common = max(seconds, key=lambda token: len(seconds[token]))
    second_counts = torch.bincount(torch.tensor(seconds[common]), minlength=97).double()
    rejected = [chi_square_rejects(counts, rows["first"].double())]
    if (rows[common] * len(seconds[common]) >= 5).sum() >= 1:  # cells enough to test (not all pooled)
        rejected.append(chi_square_rejects(second_counts, rows[common].double()))
    if kind == MEDUSA:  # Medusa's second head does not read the first token: its row is the same for all
        assert torch.equal(rows[common], executor.propose(1, 0, PROMPT, 2, params, None, features=features).probs[1])
    assert any(rejected) == (kind == "planted"), rejected


@pytest.mark.parametrize("executor", ["dynamic", "static"])
def test_a_heads_rounds_take_cached_blocks_with_the_features_kept_for_them(tiny_lm, executor):
    """A prompt's blocks are kept with the features the forward that keyed them computed: a later round that
    asks for features takes those blocks and gets every position's features, as a run without the cache
    computes them; a block keyed a round after its forward (generated tokens) has none, and such a round takes
    only the blocks before it while a plain one takes both."""
    import asyncio

    from specdec.decoding.interfaces import VerifyCall
    if executor == "dynamic":
        target = dynamic_executor(tiny_lm, prefix_cache_tokens=256, block_size=4, hidden_layers=(1,))
    else:
        target = static_executor(tiny_lm, kv_pool_tokens=512, block_size=4, max_context=128, max_batch=2, max_rows=6,
                                 min_window=16, compile="off", prefix_caching=True, hidden_layers=(1,))
    scorer, reference = LocalScorer(target), LocalScorer(dynamic_executor(tiny_lm, hidden_layers=(1,)))

    def score(on, seq_id, ids, want_features=True, keep=0, positions=1, release=True):
        scores = asyncio.run(on.score(VerifyCall(seq_id, keep, ids, positions, want_features=want_features)))
        if release:
            asyncio.run(on.release(seq_id))
        return scores

    prompt = list(range(3, 23))
    expected = score(reference, 1, prompt).features
    assert expected.shape == (len(prompt), 32)
    assert torch.allclose(score(scorer, 1, prompt).features, expected, atol=1e-10) and target.prefix_hit_tokens == 0
    again = score(scorer, 2, prompt)  # 16 positions from the cache (the last block holds the one with logits)
    assert target.prefix_hit_tokens == 16 and again.features.shape == expected.shape
    assert torch.allclose(again.features, expected, atol=1e-10)
    score(scorer, 3, prompt, want_features=False)
    assert target.prefix_hit_tokens == 32 and target.prefix_cache_bytes > 0

    # A 6-token prompt keys its first block with features; its second block is keyed by later rounds without
    short = list(range(40, 46))
    score(scorer, 4, short, release=False)
    score(scorer, 4, [50, 51], keep=6, positions=2, release=False)
    score(scorer, 4, [52], keep=8, release=False)
    asyncio.run(scorer.release(4))
    longer = short + [50, 51, 52, 53, 54, 55]
    before = target.prefix_hit_tokens
    assert torch.allclose(score(scorer, 5, longer).features, score(reference, 5, longer).features, atol=1e-10)
    assert target.prefix_hit_tokens - before == 4
    score(scorer, 6, longer, want_features=False)
    assert target.prefix_hit_tokens - before == 4 + 8

    # A first round's tree (prompt lookup's candidates after the prompt): its leading chain runs apart and
    # returns no features, so the cache is not taken and the rows are the tree's, as without a cache
    def tree_features(on, seq_id):
        call = VerifyCall(seq_id, 0, prompt + [60, 61], 3, want_features=True,
                          tree=tuple(range(-1, len(prompt) - 1)) + (len(prompt) - 1, len(prompt) - 1))
        features = asyncio.run(on.score(call)).features
        asyncio.run(on.release(seq_id))
        return features

    before = target.prefix_hit_tokens
    expected = tree_features(LocalScorer(dynamic_executor(tiny_lm, hidden_layers=(1,))), 7)
    assert expected.shape == (3, 32) and target.prefix_hit_tokens == before
    assert torch.allclose(tree_features(scorer, 7), expected, atol=1e-10) and target.prefix_hit_tokens == before


def test_the_index_lets_a_blocks_features_go_with_the_block():
    from specdec.engine.prefix_cache import ROOT, PrefixIndex
    index = PrefixIndex(4)
    first = index.add(7, ROOT, (1, 2, 3, 4))
    second = index.add(8, first, (5, 6, 7, 8))
    index.keep_features(first, torch.ones(4, 1, 2))
    assert [rows.shape for rows in index.features([first, second])] == [(4, 1, 2)]  # up to the first without
    assert index.features([second, first]) == [] and index.features_bytes == 32
    index.remove(7)
    assert index.features([first]) == [] and index.features_bytes == 0
    index.features_budget = 64  # two blocks' worth: the oldest goes first
    serials = [index.add(9 + i, ROOT, (i,) * 4) for i in range(3)]
    for serial in serials:
        index.keep_features(serial, torch.ones(4, 1, 2))
    assert index.features(serials[:1]) == [] and len(index.features(serials[1:])) == 2 and index.features_bytes == 64


def test_a_head_executor_evicts_idle_sequences_and_refuses_past_its_limit(tiny_lm):
    from specdec.engine.errors import CapacityError
    now = [0.0]
    executor = HeadExecutor(head_for(tiny_lm, EAGLE), max_sequences=2, idle_timeout_s=10, clock=lambda: now[0])
    features = torch.zeros(len(PROMPT) - 1, 32, dtype=torch.float64)
    executor.propose(1, 0, PROMPT, 2, SamplingParams(), features=features)
    now[0] = 6.0
    executor.propose(2, 0, PROMPT, 2, SamplingParams(), features=features)
    with pytest.raises(CapacityError, match="max_sequences"):
        executor.propose(3, 0, PROMPT, 2, SamplingParams(), features=features)
    now[0] = 12.0
    assert executor.evict_idle() == [1] and set(executor.sequences) == {2}
    assert executor.kv_bytes_allocated > 0 and executor.release(2) and not executor.release(2)


@pytest.mark.parametrize("kind", [EAGLE, MEDUSA])
def test_a_heads_confidence_stop_proposes_a_prefix_of_its_full_proposal(tiny_lm, kind):
    head = head_for(tiny_lm, kind, seed=2, **({"medusa_heads": 4} if kind == MEDUSA else {}))
    layers = head.config.feature_layers(2)
    with torch.no_grad():
        out = tiny_lm(torch.tensor([PROMPT]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[layer + 1][0] for layer in layers], dim=-1)[:-1]
    full = HeadExecutor(head).propose(1, 0, PROMPT, 4, SamplingParams(), features=features)
    shorter = 0
    for threshold in (0.05, 0.3, 0.9, 1.0):
        stopped = HeadExecutor(head)
        stopped.stop_below = threshold
        drafted = stopped.propose(1, 0, PROMPT, 4, SamplingParams(), features=features)
        assert 1 <= len(drafted.tokens) <= 4 and drafted.tokens == full.tokens[:len(drafted.tokens)]
        shorter += len(drafted.tokens) < len(full.tokens)
    assert len(full.tokens) == 4 and shorter >= 1
    assert len(drafted.tokens) == 1  # at 1.0 every token is below certainty: one token a round


def test_the_default_pairs_shipped_head_loads_as_the_eagle3_head_the_pair_serves():
    """The EAGLE-3 head shipped for the default pair (bfloat16 on disk) loads in the pair's float32 and its
    draft vocabulary maps into the target's (served as `eagle3`: tests/integration/test_default_pair.py)."""
    from specdec.serving import pairs

    head = load_head(pairs.DEFAULT_PAIR_HEAD)
    assert head.config.kind == EAGLE3 and head.fc.weight.dtype == torch.float32
    assert head.config.hidden_size == 576 and len(head.d2t) == 8192
    ids = head.draft_target_ids()
    assert ids.min() >= 0 and ids.max() < head.config.vocab_size and int(head.t2d.sum()) == len(head.d2t)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("kernels", ["onednn", "panels"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_head_on_other_kernels_drafts_what_it_drafts_on_torchs(tiny_lm, kind, kernels):
    """`linear_kernels: auto` may put a served head's linears on oneDNN or the panel kernel
    (onednn_linear.apply): same drafts."""
    import copy

    from specdec.engine import onednn_linear, panel_linear
    from specdec.engine.interfaces import Step

    if kernels == "panels" and (problem := panel_linear.available(torch.device("cpu"), torch.float32)):
        pytest.skip(f"the panel kernel does not build here: {problem}")
    dense = random_head(kind, tiny_lm.config, seed=3, aux_layers=AUX if kind == EAGLE3 else (),
                        **({"draft_vocab_size": 64} if kind == EAGLE3 else {})).float()
    if hasattr(dense, "attach"):
        dense.attach(*(None if t is None else t.float() for t in target_tensors(tiny_lm)))
    packed = copy.deepcopy(dense)
    assert (onednn_linear.prepack_linears if kernels == "onednn" else panel_linear.pack_linears)(packed) > 0
    features = torch.randn(len(PROMPT) - 1, dense.config.feature_width, generator=torch.Generator().manual_seed(0))
    for branches in (1, 3):
        step = Step(1, 0, PROMPT, k=4, features=features, branches=branches)
        (a,), (b,) = HeadExecutor(dense).propose_many([step]), HeadExecutor(packed).propose_many([step])
        assert (a.tokens, a.parents) == (b.tokens, b.parents) and len(a.tokens) > 0
    # what the adapter times it with (onednn_linear.apply): the head over 1..8 rows, either way
    times = onednn_linear.time_kernels(dense, rows_forward(dense), rows=(1, 3, 8), repeats=1)
    assert all(seconds > 0 for seconds in [*times.torch.values(), *times.onednn.values()])


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_a_drafting_step_computes_what_the_training_step_does(tiny_lm, kind):
    """Drafting (no gradient, on a CPU) attends without expanding the keys per query head and keeps the
    draft ids' target ids: the same logits as the training-time step, and the ids follow a changed d2t."""
    head = head_for(tiny_lm, kind, seed=3)
    width = head.config.feature_width if kind == EAGLE3 else head.config.hidden_size
    features = torch.randn(5, width, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor(PROMPT[:5])
    with torch.no_grad():
        drafted = head(tokens, head.from_target(features), HeadCache(), 0)
    with torch.enable_grad():
        trained = head(tokens, head.from_target(features), HeadCache(), 0)
    for a, b in zip(drafted, trained):
        assert torch.allclose(a, b.detach(), atol=1e-10, rtol=1e-10)
    if kind == EAGLE3:
        before = head.draft_target_ids().clone()
        with torch.no_grad():
            head.d2t[3] += 1
        assert torch.equal(head.draft_target_ids(), before + (torch.arange(len(before)) == 3))
