"""weights_dtype fp8: linear weights in FP8 e4m3 with a scale per output channel (fp8_linear.py). On CPU
the products are dequantized (the weight-only kernel runs here in Triton's interpreter); speculation stays
exact with respect to the quantized model that is served. tests/gpu runs the kernel compiled."""

import os

import asyncio
import copy

import pytest
import torch

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, generate
from specdec.engine import fp8_linear
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import Step
from specdec.engine.loading import load_causal_lm
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import noisy_copy


def quantized(model):
    model = copy.deepcopy(model)
    replaced, why_not = fp8_linear.quantize_linears(model)
    assert replaced == 2 * 7 and why_not == "not a CUDA device"  # q, k, v, o, gate, up, down per layer
    return model


def test_each_output_channel_has_its_own_scale_and_rounds_within_e4m3s_precision():
    torch.manual_seed(0)
    weight = torch.randn(6, 64, dtype=torch.float64) * torch.tensor([1e-3, 0.1, 1, 10, 300, 5e4])[:, None]
    q, scale = fp8_linear.quantize_rows(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape and scale.shape == (6,)
    assert torch.allclose(scale.double(), weight.abs().amax(1) / 448, rtol=1e-6)  # each row's largest is 448
    back = fp8_linear.dequantize(q, scale, torch.float64)
    error = (back - weight).abs()
    # 3 mantissa bits: 2^-4 relative for normal values; subnormals (below 2^-6 of the scale) within s·2^-9
    assert bool((error <= weight.abs() * 2 ** -4 + scale[:, None].double() * 2 ** -9 + 1e-12).all())
    assert 0 < error.max() and q.float().abs().amax(1).eq(448).all()


def test_an_fp8_linear_computes_with_its_dequantized_weight():
    torch.manual_seed(1)
    dense = torch.nn.Linear(48, 80, bias=True).double()
    fp8 = fp8_linear.Fp8Linear(dense)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight.element_size() == 1
    weight = fp8_linear.dequantize(fp8.weight, fp8.weight_scale, torch.float64)
    for shape in ((1, 48), (5, 48), (2, 9, 48)):
        x = torch.randn(shape, dtype=torch.float64)
        assert torch.equal(fp8(x), torch.nn.functional.linear(x, weight, dense.bias))
        assert not torch.equal(fp8(x), dense(x))  # quantized: not the dense layer's numbers
        assert torch.allclose(fp8(x), dense(x), rtol=0.1, atol=0.1)


def test_every_linear_but_the_vocabulary_head_is_quantized(tiny_lm):
    model = quantized(tiny_lm)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float64
    assert not any(type(m) is torch.nn.Linear for name, m in model.named_modules() if name != "lm_head")
    dense, fp8 = dynamic_executor(tiny_lm), dynamic_executor(model)
    a, b = dense.extend(1, 0, [5, 17, 3, 88, 4], 5), fp8.extend(1, 0, [5, 17, 3, 88, 4], 5)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.6 and not torch.equal(a, b)


def test_the_static_executor_runs_the_quantized_model_as_the_dynamic_one_does(tiny_lm):
    model = quantized(tiny_lm)
    dynamic = dynamic_executor(model)
    static = static_executor(model, kv_pool_tokens=512, block_size=8, max_context=128, max_batch=2, max_rows=5,
                             min_window=16, compile="off", prefix_caching=False)
    for lm in (dynamic, static):
        lm.extend(1, 0, [5, 17, 3, 88, 1, 2, 3, 4, 9], 1)
    steps = [Step(1, 9, [10, 11, 12], 3), Step(2, 0, [7, 8, 9, 1, 2], 2)]
    for a, b in zip(dynamic.extend_many(steps), static.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-9)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_over_fp8_models_gives_the_fp8_targets_own_output(tiny_lm, k):
    target, draft = quantized(tiny_lm), quantized(noisy_copy(tiny_lm))
    prompt = [5, 17, 3, 88, 41, 9]

    def run(proposer, scorer, k):
        async def main():
            req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=40)
            rounds = [r async for r in generate(req, proposer, scorer, DraftLengthPolicy.fixed(k))]
            return [t for r in rounds for t in r.new_tokens], sum(r.num_accepted for r in rounds)
        return asyncio.run(main())

    alone, _ = run(LocalProposer(dynamic_executor(draft)), LocalScorer(dynamic_executor(target)), 0)
    speculative, accepted = run(LocalProposer(dynamic_executor(draft)), LocalScorer(dynamic_executor(target)), k)
    assert speculative == alone and accepted > 0
    dense, _ = run(LocalProposer(dynamic_executor(tiny_lm)), LocalScorer(dynamic_executor(tiny_lm)), 0)
    assert dense != alone  # the quantized model is another model: exactness is with respect to it


def test_loading_with_fp8_weights_says_how_and_refuses_what_cannot_be(tiny_lm, tmp_path):
    tiny_lm.save_pretrained(tmp_path)
    lines = []
    model = load_causal_lm(str(tmp_path), dtype="float32", weights_dtype="fp8", log=lines.append)
    assert isinstance(model.model.layers[0].self_attn.q_proj, fp8_linear.Fp8Linear)
    assert len(lines) == 1 and "14 linear layers in FP8" in lines[0] and "dequantized (not a CUDA device)" in lines[0]
    assert not model.model.layers[0].self_attn.q_proj.kernel  # auto never takes Triton's interpreter
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        load_causal_lm(str(tmp_path), weights_dtype="int4")
    for kernels in ("onednn", "panels"):
        with pytest.raises(ValueError, match=f"weights_dtype=fp8 and linear_kernels={kernels}"):
            load_causal_lm(str(tmp_path), weights_dtype="fp8", linear_kernels=kernels)


def test_the_fp8_quality_bench_runs_and_its_references_agree_with_themselves(tmp_path):
    """`bench/fp8_quality.py` on the tiny pair: a row per setting; float32 and bfloat16 are their own references."""
    from bench import fp8_quality

    out = tmp_path / "fp8.md"
    assert fp8_quality.main(["--pair", "tiny", "--prompts", "1", "--max-tokens", "6", "--out", str(out)]) == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.read_text().splitlines() if line.startswith("| ") and "NLL" not in line}
    assert set(rows) == {label for label, _, _ in fp8_quality.SETTINGS}
    assert rows["float32"][3] == "1.000" and rows["bfloat16"][2] == "1.000" and rows["bfloat16"][4] == "2/2"



def test_the_benchs_dense_equivalent_computes_what_the_fp8_model_does(tiny_lm):
    from bench import fp8_quality

    model = quantized(tiny_lm)
    dense = fp8_quality.dense_equivalent(copy.deepcopy(model))
    assert not any(isinstance(m, fp8_linear.Fp8Linear) for m in dense.modules())
    ids = torch.tensor([[5, 17, 3, 88, 4]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, dense(ids).logits)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or fp8_linear.kernel_unavailable(
    torch.device("cpu"), torch.float32) is not None, reason="the kernel's CPU test runs in Triton's interpreter")
def test_the_weight_only_kernel_computes_the_dequantized_product():
    """Up to 128 rows, each program reads its output channels' FP8 weights once for every row of its tile
    (masks at every edge: rows, channels and the inner size not multiples of the tiles; row tiles of 16, then
    of 64); more rows are dequantized."""
    torch.manual_seed(2)
    for bias in (True, False):
        dense = torch.nn.Linear(300, 77, bias=bias)
        fast, slow = fp8_linear.Fp8Linear(dense, kernel=True), fp8_linear.Fp8Linear(dense, kernel=False)
        for shape in ((1, 300), (5, 300), (2, 8, 300), (17, 300), (70, 300), (129, 300)):
            x = torch.randn(shape)
            assert torch.allclose(fast(x), slow(x), rtol=1e-5, atol=1e-5), (bias, shape)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    assert fp8_linear.quantize_linears(model, kernel=True) == (1, None) and model[0].kernel
    with pytest.raises(ValueError, match="the FP8 kernel cannot run here"):
        fp8_linear.quantize_linears(torch.nn.Sequential(torch.nn.Linear(8, 8).double()), kernel=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or fp8_linear.kernel_unavailable(
    torch.device("cpu"), torch.float32) is not None, reason="the kernel's CPU test runs in Triton's interpreter")
@pytest.mark.parametrize("config", [fp8_linear.KernelConfig(), fp8_linear.KernelConfig(16, 128, 4, 3, 8),
                                    fp8_linear.KernelConfig(32, 256, 4, 3, 0)])
def test_a_product_split_along_k_sums_its_slices_in_order_and_leaves_its_counts_at_zero(config):
    """Programs per multiprocessor past one: the K-slices' partials are summed by the tile's last program in
    slice order: the dequantized product, the same bits call after call and for a row alone or beside
    others; the per-tile counts are back at zero for the next product (CUDA graph replays)."""
    torch.manual_seed(3)
    dense = torch.nn.Linear(1300, 77)
    q, scale = fp8_linear.quantize_rows(dense.weight)
    x = torch.randn(5, 1300)
    config_, tile, slices, per_slice = fp8_linear.launch(len(x), q, config)
    assert tile == fp8_linear.TILE_ROWS and (slices > 1) == (config.waves > 0) and slices * per_slice >= 1300
    got = fp8_linear.kernel_product(x, q, scale, dense.bias, config)
    expected = torch.nn.functional.linear(x, fp8_linear.dequantize(q, scale, torch.float32), dense.bias)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(fp8_linear.kernel_product(x, q, scale, dense.bias, config), got)
    assert torch.equal(fp8_linear.kernel_product(x[2:3], q, scale, dense.bias, config), got[2:3])
    if slices > 1:
        _, counts = fp8_linear.workspace(q.device, 77, config, slices)
        assert not counts.any()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or fp8_linear.kernel_unavailable(
    torch.device("cpu"), torch.float32) is not None, reason="the kernel's CPU test runs in Triton's interpreter")
def test_the_kernel_bench_checks_every_launch_and_prints_the_fastest(capsys):
    """bench/fp8_kernel_bench.py (what gpu_session's fp8 part serves with), on tiny shapes."""
    from bench import fp8_kernel_bench

    assert fp8_kernel_bench.main(["--small", "--matrices", "1"]) == 0
    out = capsys.readouterr().out
    assert "fp8 kernel, wide tiles" in out and "fp8 dequantized + dense" in out
    best = out.strip().splitlines()[-1]
    assert best.startswith("best: ") and fp8_linear.KernelConfig.parse(best[6:]) in fp8_kernel_bench.launches(True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or fp8_linear.kernel_unavailable(
    torch.device("cpu"), torch.float32) is not None, reason="the kernel's CPU test runs in Triton's interpreter")
def test_the_dequantizing_kernel_gives_the_same_numbers_as_the_tensor_expression():
    """Past 128 rows a GPU dequantizes each weight in one kernel: float32 product, rounded once, as before."""
    torch.manual_seed(4)
    q, scale = fp8_linear.quantize_rows(torch.randn(7, 2500))
    expected = (q.float() * scale[:, None]).to(torch.float32)
    assert torch.equal(fp8_linear.kernel_dequantize(q, scale, torch.float32), expected)


def test_fp8_linears_reading_one_input_are_fused_into_one_product_with_views_of_its_weights(tiny_lm):
    """The executor's fused query/key/value (and gate/up) product over FP8 layers: their weights and scales
    concatenated, exactly what the separate layers compute, the layers' buffers views of the fused ones."""
    from specdec.engine.llama_forward import fuse_linears

    model = quantized(tiny_lm)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    fused = fuse_linears(attn, ("q_proj", "k_proj", "v_proj"))
    assert isinstance(fused, fp8_linear.Fp8Linear) and torch.equal(fused(x), separate)
    assert attn.k_proj.weight.data_ptr() == fused.weight[attn.q_proj.out_features:].data_ptr()
    assert fuse_linears(attn, ("q_proj", "k_proj", "v_proj")) is fused  # a second executor: the same one


def _fp8_checkpoint(model, directory, method: str, per_tensor: bool):
    """`model` written as an FP8 checkpoint of `method`'s layout: every linear but lm_head in float8_e4m3fn
    with its weight_scale (per channel (out, 1), or per tensor: a scalar) and, for ModelOpt, an input_scale."""
    import json

    from safetensors.torch import save_file

    model.save_pretrained(directory)
    tensors = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and not name.endswith("lm_head"):
            weight = module.weight.detach().float()
            scale = weight.abs().amax() / 448 if per_tensor else weight.abs().amax(1, keepdim=True) / 448
            tensors[name + ".weight"] = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name + ".weight_scale"] = scale.float()
            if method == "modelopt":
                tensors[name + ".input_scale"] = torch.tensor(1.0)
    for key, value in model.state_dict().items():
        tensors.setdefault(key, value.float().contiguous())
    for linear in [key[:-len(".weight_scale")] for key in tensors if key.endswith(".weight_scale")]:
        assert tensors[linear + ".weight"].dtype == torch.float8_e4m3fn
    (directory / "model.safetensors").unlink()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("method,per_tensor", [("compressed-tensors", False), ("modelopt", True), ("fp8", True)])
def test_an_fp8_checkpoint_is_served_as_it_is_stored(tiny_lm, tmp_path, method, per_tensor):
    """compressed-tensors (a scale per channel), ModelOpt and AutoFP8 (one per tensor, activation scales
    beside): the FP8 weights and scales are used as stored, the rest of the model as it was."""
    dense = copy.deepcopy(tiny_lm).float()
    tensors = _fp8_checkpoint(dense, tmp_path, method, per_tensor)
    lines = []
    model = load_causal_lm(str(tmp_path), dtype="float32", log=lines.append)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, fp8_linear.Fp8Linear) and type(model.lm_head) is not fp8_linear.Fp8Linear
    assert torch.equal(q_proj.weight.float(), tensors["model.layers.1.self_attn.q_proj.weight"].float())
    assert "14 linear layers in FP8 (14 as the checkpoint stores them, 0 quantized at load" in lines[0]
    # The reference: the dense model with each weight replaced by its stored FP8 value times its scale
    reference = copy.deepcopy(dense)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name + ".weight_scale" in tensors:
                module.weight.copy_(tensors[name + ".weight"].float() * tensors[name + ".weight_scale"])
    ids = torch.tensor([[5, 17, 3, 88, 4, 61]])
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)
        assert not torch.allclose(model(ids).logits, dense(ids).logits, atol=1e-5)  # not the dense weights


def test_an_fp8_checkpoint_that_does_not_fit_is_refused_naming_what(tiny_lm, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = _fp8_checkpoint(copy.deepcopy(tiny_lm).float(), tmp_path, "compressed-tensors", False)
    blocks = dict(tensors, **{"model.layers.0.mlp.up_proj.weight_scale": torch.ones(2, 2)})
    save_file(blocks, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: weight_scale of shape \(2, 2\).*not per block"):
        load_causal_lm(str(tmp_path))
    unscaled = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items()
                if k != "model.layers.0.mlp.up_proj.weight_scale"}
    save_file(unscaled, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight is FP8 without a weight_scale"):
        load_causal_lm(str(tmp_path))
