"""The panel kernel (csrc/panel_linear.cpp) computes what a dense float32 linear layer does, the same
numbers for a row whatever else is in the forward, and the loader picks it where it times fastest."""

import copy
import os

import pytest
import torch

from specdec.engine import onednn_linear, panel_linear
from specdec.engine.build import ExecutorConfig, build_executor, dynamic_executor
from specdec.engine.executor import Step

problem = panel_linear.available(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(problem is not None, reason=f"the panel kernel does not build here: {problem}")


def test_pack_lays_each_panels_columns_side_by_side_and_zero_fills_the_last():
    weight = torch.arange(130 * 3, dtype=torch.float32).view(130, 3)  # 130 outputs: panels of 64, 64, 2
    panels = panel_linear.pack(weight)
    assert panels.shape == (3, 3, panel_linear.PANEL) and panels.is_contiguous()
    for p, k, c in ((0, 0, 0), (0, 2, 63), (1, 1, 5), (2, 0, 1)):
        assert panels[p, k, c] == weight[p * panel_linear.PANEL + c, k]
    assert not panels[2, :, 2:].any()


@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_dense_for_any_row_count_and_width(bias):
    torch.manual_seed(1)
    for in_features, out_features in ((48, 300), (576, 192), (33, 64), (7, 1)):
        dense = torch.nn.Linear(in_features, out_features, bias=bias)
        panels = panel_linear.PanelLinear(dense)
        with torch.inference_mode():
            for shape in ((0, in_features), (1, in_features), (5, in_features), (2, 9, in_features),
                          (1, 257, in_features)):
                x = torch.randn(shape)
                assert panels(x).shape == dense(x).shape
                assert torch.allclose(panels(x), dense(x), atol=1e-5, rtol=1e-5), (in_features, out_features, shape)
            strided = torch.randn(in_features, 6).t()  # a non-contiguous input
            assert torch.allclose(panels(strided), dense(strided), atol=1e-5, rtol=1e-5)


def _gguf_made(kind: str, out_features: int, in_features: int, seed: int = 3) -> torch.Tensor:
    """A weight as GGUF's dequantizer writes it: Q4_1 (codes 0-15 times a half-precision scale plus a
    half-precision offset per 32 inputs), Q8_0 (codes -127..127 times a scale), or bfloat16 values."""
    generator = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // 32, 32)
    scale = (torch.rand(*blocks[:2], 1, generator=generator) * 0.02 + 1e-3).half().float()
    if kind == "q4":
        codes = torch.randint(0, 16, blocks, generator=generator).float()
        codes[..., 0], codes[..., 1] = 0, 15  # Q4_1's offset is the block's least value, its scale (max - min) / 15
        offset = (-torch.rand(*blocks[:2], 1, generator=generator) * 0.1).half().float()
        return (codes * scale + offset).view(out_features, in_features)
    if kind == "q8":
        codes = torch.randint(-127, 128, blocks, generator=generator).float()
        codes[..., 0] = 127  # Q8_0's scale is the block's greatest magnitude / 127
        return (codes * scale).view(out_features, in_features)
    return torch.randn(out_features, in_features, generator=generator).bfloat16().float()


@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
def test_an_encoded_layer_gives_the_float32_kernels_bits_for_fewer_bytes(kind):
    """Weights made as GGUF's blocks (or bfloat16) are recognised, held encoded, and every product is
    the float32 kernel's bit for bit, for any row count; a weight one bit off any encoding stays float32."""
    in_features, out_features = 576, 150  # 150: a last panel of 22 columns
    _check_encoded(kind, in_features, out_features)
    _check_encoded(kind, 64, 100)  # a last panel of 36 columns: its second half partly filled


def _check_encoded(kind, in_features, out_features):
    dense = torch.nn.Linear(in_features, out_features, bias=True)
    dense.weight.data = _gguf_made(kind, out_features, in_features)
    encoded = panel_linear.PanelLinear(dense)
    plain = panel_linear.PanelLinear(dense, encoding=False)
    assert (encoded.encoding, plain.encoding) == (kind, "float32")
    ratio = sum(t.nbytes for t in encoded.weights) / sum(t.nbytes for t in plain.weights)
    assert ratio <= {"q4": 0.19, "q8": 0.32, "bf16": 0.5}[kind]
    torch.manual_seed(4)
    with torch.inference_mode():
        # every block shape: with AVX-512 full panels to 6 rows, half panels of 12 beyond; with 16 registers
        # 2-row blocks, then tiles in even blocks of up to 6 rows (31: five of 6 and one of 1)
        for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 25, 31):
            x = torch.randn(rows, in_features)
            got, want = encoded(x), plain(x)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, rows)
            assert torch.allclose(got, dense(x), atol=1e-4, rtol=1e-4)
    off = dense.weight.data.clone()
    off[7, 40] = torch.nextafter(off[7, 40], torch.tensor(1.0))  # no longer a block's value, nor a bfloat16
    assert panel_linear.encode(off).kind == "float32"


def test_the_encodings_can_be_narrowed_for_a_measurement(monkeypatch):
    weight = _gguf_made("q4", 64, 64)
    monkeypatch.setenv(panel_linear.ENCODINGS_ENV, "bf16,q8")
    assert panel_linear.encode(weight).kind == "float32"  # a Q4_1 weight is neither Q8_0 nor bfloat16
    monkeypatch.setenv(panel_linear.ENCODINGS_ENV, "q5")
    with pytest.raises(ValueError, match="unknown encodings"):
        panel_linear.encode(weight)


def test_a_rows_result_is_the_same_bits_whatever_else_is_in_the_forward():
    """Rows are summed in one fixed order: row i of an M-row product equals row i alone, for every M
    (the row blocks, their remainders, float32's tiles past 8 rows on a 16-register CPU) and with one thread
    or two."""
    torch.manual_seed(2)
    layer = panel_linear.PanelLinear(torch.nn.Linear(200, 150, bias=False))
    x = torch.randn(31, 200)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            alone = [layer(x[i:i + 1]) for i in range(len(x))]
            for rows in (2, 3, 5, 6, 7, 9, 13, 14, 31):
                together = layer(x[:rows])
                assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows)), rows
            torch.set_num_threads(1)
            assert torch.equal(layer(x), torch.cat(alone))
    finally:
        torch.set_num_threads(threads)


def test_a_verify_on_panels_scores_what_the_steps_one_at_a_time_score(fp32_llama):
    """To float rounding: the attention's kernels for 4 queries and for 1 differ; the linear layers' rows
    do not (test above). The model's logits against the dense model's: test_onednn_linear."""
    model = copy.deepcopy(fp32_llama)
    assert panel_linear.pack_linears(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + head
    panels = dynamic_executor(model)
    tokens = [21, 4, 60, 33]
    panels.extend(3, 0, [5, 17, 3, 88], 1)
    panels.extend(4, 0, [5, 17, 3, 88], 1)
    verified = panels.extend_many([Step(3, 4, tokens, 4)])[0]
    stepped = torch.cat([panels.extend_many([Step(4, 4 + i, [token], 1)])[0] for i, token in enumerate(tokens)])
    assert torch.allclose(verified, stepped, atol=1e-5)


def test_choose_takes_panels_where_their_forwards_took_least_in_all(fp32_llama, monkeypatch):
    monkeypatch.setenv(onednn_linear.TIMES_DIR_ENV, "")  # each planted timing is taken, none read back
    times = onednn_linear.KernelTimes
    # the Xeon's shape: torch's fastest at 1 row, oneDNN's from 4, panels about torch's at 1 and far ahead after
    xeon = times({1: 1.0, 4: 1.6, 8: 1.9}, {1: 1.4, 4: 1.4, 8: 1.7}, 1, {1: 1.02, 4: 1.05, 8: 1.3})
    assert xeon.panels_faster and xeon.mixed() == {1: 1.0, 4: 1.4, 8: 1.7}
    slower = times({1: 1.0, 4: 1.6, 8: 1.9}, {1: 1.4, 4: 1.4, 8: 1.7}, 1, {1: 1.5, 4: 1.5, 8: 1.6})
    assert not slower.panels_faster and not times({1: 1.0}, {1: 2.0}, 1).panels_faster  # not timed: never
    for planted, panels in ((xeon, True), (slower, False)):
        monkeypatch.setattr(onednn_linear, "time_kernels", lambda model, forward, rows, kept, planted=planted: planted)
        choice = onednn_linear.choose("auto", fp32_llama)
        assert choice.panels == panels and choice.times is planted and choice.min_forward_rows == 1
    assert "the panel kernel" in onednn_linear.KernelChoice(None, 1, xeon, panels=True).summary()
    assert "panels {1: 1020.00" in xeon.summary()
    assert onednn_linear.choose("panels", fp32_llama) == onednn_linear.PANELS  # asked for: untimed


def test_panels_are_refused_by_name_where_they_cannot_run(fp32_llama, monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="linear_kernels=panels: the panel kernel runs float32 models on the CPU"):
        onednn_linear.resolve("panels", cpu, torch.bfloat16)
    monkeypatch.setattr(panel_linear, "build", lambda: panel_linear.Build(None, "planted: no compiler"))
    with pytest.raises(ValueError, match="linear_kernels=panels: planted: no compiler"):
        onednn_linear.choose("panels", fp32_llama)
    # auto times the other two, goes on without it and says why
    assert onednn_linear.time_kernels(fp32_llama, onednn_linear.causal_lm_forward(fp32_llama), rows=(1,),
                                      repeats=1).panels is None
    lines = []
    model = copy.deepcopy(fp32_llama)
    assert not onednn_linear.apply("auto", model, "tiny", lines.append).panels
    assert lines[-1] == "tiny: the panel kernel was not timed: planted: no compiler"


def test_a_failed_build_says_why_and_leaves_no_kernel(tmp_path, monkeypatch):
    """A compile that fails (the compiler a stand-in that fails at once: the real one parses torch's headers
    for a minute first)."""
    broken = tmp_path / "panel_linear.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(panel_linear, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    compiler = tmp_path / "c++"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && exec c++ --version\necho "planted: no C++ here" >&2\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    built = panel_linear.build.__wrapped__()
    assert built.op is None and "build stopped" in built.problem


def test_the_build_finds_the_virtualenvs_ninja_without_it_on_path(tmp_path, monkeypatch):
    """A server started as `.venv/bin/python -m ...` has no virtualenv bin on PATH: the build puts the ninja
    package's there while it runs, and puts PATH back."""
    import ninja
    import torch.utils.cpp_extension

    seen = []

    def load(*args, **kwargs):
        seen.append(os.environ["PATH"])
        raise RuntimeError("planted: stop here")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = panel_linear.build.__wrapped__()
    assert built.op is None and "planted: stop here" in built.problem
    assert seen == [f"{ninja.BIN_DIR}{os.pathsep}/usr/bin:/bin"] and os.environ["PATH"] == "/usr/bin:/bin"


def test_the_loader_and_the_executor_run_panels_unpadded(fp32_llama, tmp_path):
    from specdec.engine.loading import load_causal_lm

    fp32_llama.save_pretrained(tmp_path)
    lines = []
    model = load_causal_lm(str(tmp_path), linear_kernels="panels", log=lines.append)
    assert model.linear_kernel_choice == onednn_linear.PANELS
    assert sum(isinstance(m, panel_linear.PanelLinear) for m in model.modules()) == 2 * 7 + 1
    lm = build_executor(model, ExecutorConfig(executor="dynamic"))
    assert lm.forward.min_forward_rows == 1 and not lm.forward.row_buckets
    auto = load_causal_lm(str(tmp_path), linear_kernels="auto")
    held = any(isinstance(m, panel_linear.PanelLinear) for m in auto.modules())
    assert held == auto.linear_kernel_choice.panels and auto.linear_kernel_choice.times.panels is not None


def test_weights_rounded_to_8_bit_blocks_are_held_as_their_codes_and_4_bit_ones_stay(fp32_llama, tmp_path):
    """weights_dtype q8 (panel_linear.round_q8): each block of 32 inputs within half a step of its scale
    (greatest magnitude / 127), held by the 8-bit encoding exactly, whatever the weights' magnitude (zero
    blocks too); weights a GGUF file held in 4-bit blocks are left as they are; the loader says so and
    refuses it off the CPU's float32 panel kernel."""
    from specdec.engine.loading import load_causal_lm

    gen = torch.Generator().manual_seed(0)
    for magnitude in (1e-4, 1.0, 30.0):
        weight = torch.randn(70, 96, generator=gen) * magnitude
        weight[5, 32:64] = 0
        rounded = panel_linear.round_q8(weight)
        step = weight.view(70, 3, 32).abs().amax(-1, keepdim=True) / 127
        assert ((rounded - weight).view(70, 3, 32).abs() <= step / 2 * (1 + 1e-5)).all()
        assert panel_linear.encode(rounded).kind == "q8" and torch.equal(rounded[5, 32:64], torch.zeros(32))
        assert 0 < (rounded - weight).norm() / weight.norm() < 0.01
    assert torch.equal(panel_linear.round_q8(torch.ones(4, 30)), torch.ones(4, 30))  # no whole blocks: as it is
    model = copy.deepcopy(fp32_llama)
    q4 = model.model.layers[0].mlp.down_proj.weight
    codes = torch.randint(0, 16, q4.shape, generator=gen).float()
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # each block spans its codes (its scale read back from them)
    with torch.no_grad():
        q4.copy_(codes * 0.0625 - 0.5)  # a 4-bit block's values: codes x a half-precision scale + the least
    kept = q4.detach().clone()
    assert panel_linear.quantize_linears(model) == 2 * 7 + 1 - 1
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, kept)
    assert torch.equal(model.model.embed_tokens.weight, fp32_llama.model.embed_tokens.weight)
    fp32_llama.save_pretrained(tmp_path)
    lines = []
    loaded = load_causal_lm(str(tmp_path), weights_dtype="q8", linear_kernels="panels", log=lines.append)
    assert "15 linear layers rounded to 8-bit blocks" in lines[0]
    assert {m.encoding for m in loaded.modules() if isinstance(m, panel_linear.PanelLinear)} == {"q8"}
    for kwargs in ({"dtype": "bfloat16"}, {"linear_kernels": "onednn"}, {"device": "meta"}):
        with pytest.raises(ValueError, match="weights_dtype=q8"):
            load_causal_lm(str(tmp_path), weights_dtype="q8", **kwargs)
