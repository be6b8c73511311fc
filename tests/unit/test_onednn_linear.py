"""oneDNN-prepacked linear layers compute what the dense layers do."""

import copy
import hashlib
import json

import pytest
import torch

from specdec.engine import onednn_linear
from specdec.engine.build import dynamic_executor
from specdec.engine.executor import Step

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def test_prepacked_linear_matches_dense_for_any_row_count():
    torch.manual_seed(1)
    dense = torch.nn.Linear(48, 300)
    packed = onednn_linear.PrepackedLinear(dense)
    with torch.inference_mode():
        for shape in ((1, 48), (3, 48), (2, 9, 48), (1, 257, 48)):
            x = torch.randn(shape)
            assert packed(x).shape == dense(x).shape
            assert torch.allclose(packed(x), dense(x), atol=1e-5), shape


@pytest.mark.parametrize("kernels", ["onednn", "panels"])
def test_a_model_on_other_kernels_gives_the_dense_models_logits(fp32_llama, kernels):
    from specdec.engine import panel_linear

    if kernels == "panels" and (problem := panel_linear.available(torch.device("cpu"), torch.float32)):
        pytest.skip(f"the panel kernel does not build here: {problem}")
    packed_model = copy.deepcopy(fp32_llama)
    pack = onednn_linear.prepack_linears if kernels == "onednn" else panel_linear.pack_linears
    assert pack(packed_model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + head
    assert not any(isinstance(m, torch.nn.Linear) for m in packed_model.modules())
    dense, packed = dynamic_executor(copy.deepcopy(fp32_llama)), dynamic_executor(packed_model)
    for lm in (dense, packed):
        lm.extend(1, 0, [5, 17, 3, 88], 1)
    steps = [Step(1, 4, [10, 11, 12], 3), Step(2, 0, [7, 8, 9, 1, 2], 2)]
    for a, b in zip(dense.extend_many(steps), packed.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-4)


def test_resolve_picks_onednn_only_where_it_runs():
    cpu = torch.device("cpu")
    assert onednn_linear.resolve("auto", cpu, torch.float32)
    assert not onednn_linear.resolve("auto", cpu, torch.float64)  # the tiny test pair: exact float64
    assert not onednn_linear.resolve("auto", torch.device("cuda"), torch.float16)
    assert not onednn_linear.resolve("torch", cpu, torch.float32)
    with pytest.raises(ValueError, match="linear_kernels=onednn needs a CPU model"):
        onednn_linear.resolve("onednn", cpu, torch.float64)
    with pytest.raises(ValueError, match="linear_kernels must be one of"):
        onednn_linear.resolve("mkl", cpu, torch.float32)


def test_bfloat16_takes_onednn_only_on_a_cpu_whose_onednn_reorders_it(fp32_llama):
    """oneDNN reorders bfloat16 weights only with AVX-512 or AVX-NE-CONVERT: elsewhere (AMD Zen 3, client
    Intel CPUs) the reorder raised at load, so a bfloat16 model with linear_kernels=auto failed to load."""
    cpu = torch.device("cpu")
    model = copy.deepcopy(fp32_llama).to(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert onednn_linear.resolve("auto", cpu, torch.bfloat16)
        assert onednn_linear.choose("onednn", model) == onednn_linear.ONEDNN
    else:
        assert not onednn_linear.resolve("auto", cpu, torch.bfloat16)
        with pytest.raises(ValueError, match="linear_kernels=onednn bfloat16 needs a CPU with AVX-512"):
            onednn_linear.resolve("onednn", cpu, torch.bfloat16)
    choice = onednn_linear.apply("auto", model)  # loads wherever it runs, and serves
    assert choice.name in ("torch", "onednn", "panels") or choice.name.startswith("torch <")
    lm = dynamic_executor(model)
    logits = lm.extend(1, 0, [5, 17, 3, 88], 1)
    assert torch.isfinite(logits.float()).all()


def test_time_kernels_times_the_models_forward_both_ways_and_leaves_it_on_torchs(fp32_llama):
    before = [id(m) for m in fp32_llama.modules() if isinstance(m, torch.nn.Linear)]
    times = onednn_linear.time_kernels(fp32_llama, onednn_linear.causal_lm_forward(fp32_llama), rows=(1, 2, 3, 4),
                                       repeats=2)
    for kernel in (times.torch, times.onednn):
        assert list(kernel) == [1, 2, 3, 4] and all(seconds > 0 for seconds in kernel.values())
    assert [id(m) for m in fp32_llama.modules() if isinstance(m, torch.nn.Linear)] == before  # the same layers back
    assert times.linear_bytes == sum(m.weight.numel() * 4 for m in fp32_llama.modules() if isinstance(m, torch.nn.Linear))
    assert "ms by rows: torch {1: " in times.summary()
    calls = []
    with pytest.raises(RuntimeError, match="planted"):  # a forward that fails still leaves torch's layers
        onednn_linear.time_kernels(fp32_llama, lambda n: calls.append(n) or (_ for _ in ()).throw(RuntimeError("planted")))
    assert [id(m) for m in fp32_llama.modules() if isinstance(m, torch.nn.Linear)] == before and calls


def test_a_small_models_timing_repeats_as_often_as_its_budget_holds(fp32_llama):
    """A draft head's forwards take a millisecond: 3 repeats beside other stubs loading chose by noise."""
    kinds = 3 if onednn_linear.panel_linear.available(torch.device("cpu"), torch.float32) is None else 2
    forward = onednn_linear.causal_lm_forward(fp32_llama)
    for budget, expected in ((0.0, 3), (60.0, 7)):  # no budget: the repeats asked; a large one: the most
        calls = []
        onednn_linear.time_kernels(fp32_llama, lambda n: calls.append(n) or forward(n), rows=(1, 2), repeats=3,
                                   budget_s=budget, most_repeats=7)
        assert len(calls) == 2 * kinds * (1 + expected)


def test_q8_weights_go_to_the_panel_kernel_untimed():
    from specdec.engine import panel_linear
    from specdec.engine.loading import q8_kernels

    builds = panel_linear.available(torch.device("cpu"), torch.float32) is None
    assert q8_kernels("auto", "q8") == ("panels" if builds else "auto")
    assert q8_kernels("auto", "same") == "auto" and q8_kernels("panels", "q8") == "panels"


def test_each_row_count_runs_on_the_faster_kernel_and_torch_pads_only_where_that_was_faster():
    times = onednn_linear.KernelTimes
    # torch's products stream faster at 1-3 rows (MKL on an Intel CPU), oneDNN's from 4: switched at 4
    mkl = times({1: 1.0, 2: 1.0, 3: 1.1, 4: 1.6, 8: 2.0}, {1: 1.5, 2: 1.5, 3: 1.5, 4: 1.5, 8: 1.6}, 1)
    assert mkl.onednn_from == 4 and mkl.torch_min_rows == 1
    # a BLAS whose 2-3-row products are slower than 4 rows, and oneDNN faster throughout: oneDNN's from 1
    cliff = times({1: 2.0, 2: 3.0, 3: 3.2, 4: 2.5, 8: 3.0}, {1: 1.4, 2: 1.4, 3: 1.5, 4: 1.5, 8: 1.6}, 1)
    assert cliff.onednn_from == 1 and cliff.torch_min_rows == onednn_linear.TORCH_PADDED_ROWS
    # torch's faster at the most rows: torch's throughout, whatever a middle row count measured
    assert times({1: 1.0, 4: 2.0, 8: 2.0}, {1: 2.0, 4: 1.0, 8: 2.5}, 1).onednn_from is None
    assert times({1: 1.0}, {1: 2.0}, 1).torch_min_rows == 1  # 2-4 rows not timed: nothing to pad for


def test_a_layer_switched_by_rows_runs_torchs_kernel_below_the_switch_and_onednns_from_it(monkeypatch):
    torch.manual_seed(2)
    dense = torch.nn.Linear(48, 300)
    switched = onednn_linear.PrepackedLinear(dense, torch_below=4)
    assert onednn_linear.PrepackedLinear(dense).dense_weight is None  # oneDNN throughout: no dense copy kept
    used = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: used.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        for shape in ((1, 48), (3, 48), (1, 3, 48), (4, 48), (2, 5, 48)):
            assert torch.allclose(switched(torch.ones(shape)), dense(torch.ones(shape)), atol=1e-5), shape
    assert used == [(4, 48), (2, 5, 48)]  # rows = every leading dimension together


def test_choose_follows_the_setting_and_auto_follows_the_timing(fp32_llama, monkeypatch):
    monkeypatch.setenv(onednn_linear.TIMES_DIR_ENV, "")  # each planted timing is taken, none read back
    assert onednn_linear.choose("torch", fp32_llama) == onednn_linear.TORCH
    assert onednn_linear.choose("onednn", fp32_llama) == onednn_linear.ONEDNN
    assert onednn_linear.choose("auto", fp32_llama.double()) == onednn_linear.TORCH  # no oneDNN: untimed
    fp32_llama.float()
    planted = {1: onednn_linear.KernelTimes({1: 2.0, 4: 2.0}, {1: 1.0, 4: 1.0}, 1),
               4: onednn_linear.KernelTimes({1: 1.0, 4: 2.0}, {1: 2.0, 4: 1.0}, 1),
               None: onednn_linear.KernelTimes({1: 1.0, 2: 3.0, 4: 2.0}, {1: 2.0, 2: 2.0, 4: 2.5}, 1)}
    for start, times in planted.items():
        monkeypatch.setattr(onednn_linear, "time_kernels", lambda model, forward, rows, kept, times=times: times)
        choice = onednn_linear.choose("auto", fp32_llama)
        assert choice.onednn_from == start and choice.times is times
        assert choice.min_forward_rows == (onednn_linear.TORCH_PADDED_ROWS if start is None else None if start == 1 else 1)
    assert "torch's own kernels below 4 rows" in onednn_linear.KernelChoice(4, 1, planted[4]).summary()
    assert "padded to 4" in onednn_linear.KernelChoice(None, 4, planted[None]).summary()


def test_the_executor_pads_rows_as_the_loaders_choice_says(fp32_llama):
    from specdec.engine.build import ExecutorConfig, build_executor

    model = copy.deepcopy(fp32_llama)
    assert build_executor(model, ExecutorConfig(executor="dynamic")).forward.min_forward_rows == 4  # untimed CPU rule
    model.linear_kernel_choice = onednn_linear.KernelChoice(onednn_from=None, min_forward_rows=1)
    assert build_executor(model, ExecutorConfig(executor="dynamic")).forward.min_forward_rows == 1
    assert build_executor(model, ExecutorConfig(executor="dynamic", min_forward_rows=3)).forward.min_forward_rows == 3


def test_the_loader_times_auto_and_records_its_choice(fp32_llama, tmp_path):
    from specdec.engine.loading import load_causal_lm

    fp32_llama.save_pretrained(tmp_path)
    lines = []
    model = load_causal_lm(str(tmp_path), linear_kernels="auto", log=lines.append)
    choice = model.linear_kernel_choice
    assert choice.times is not None and any("forwards timed with" in line for line in lines)
    packed = [m for m in model.modules() if isinstance(m, onednn_linear.PrepackedLinear)]
    assert bool(packed) == (choice.onednn_from is not None)
    assert all(m.torch_below == choice.onednn_from for m in packed)
    assert load_causal_lm(str(tmp_path), linear_kernels="torch").linear_kernel_choice == onednn_linear.TORCH


def test_models_too_large_to_time_take_onednn_untimed(fp32_llama, monkeypatch):
    monkeypatch.setattr(onednn_linear, "TIMED_MAX_BYTES", 1)
    monkeypatch.setattr(onednn_linear, "time_kernels", lambda *args: pytest.fail("timed"))
    assert onednn_linear.choose("auto", fp32_llama) == onednn_linear.ONEDNN


def test_one_timing_at_a_time_on_the_machine(fp32_llama):
    """While a model is timed, the machine's lock is held: another stub's timing (another open of the
    lock file) waits; afterwards it is free."""
    import fcntl
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "specdec-linear-kernels.lock")
    held = []

    def forward(n):
        with open(path, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
                fcntl.flock(other, fcntl.LOCK_UN)
            except BlockingIOError:
                held.append(True)

    onednn_linear.time_kernels(fp32_llama, forward, rows=(1, 2), repeats=1)
    assert held and all(held)
    with open(path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
        fcntl.flock(other, fcntl.LOCK_UN)


def test_timings_are_kept_and_read_back_for_the_same_model_on_the_same_machine(fp32_llama, monkeypatch, tmp_path):
    monkeypatch.setenv(onednn_linear.TIMES_DIR_ENV, str(tmp_path / "times"))
    timings = []
    planted = onednn_linear.KernelTimes({1: 1.0, 4: 2.0}, {1: 2.0, 4: 1.0}, 7, {1: 3.0, 4: 3.0})

    def timing(model, forward, rows, kept):
        timings.append(rows)
        return planted

    monkeypatch.setattr(onednn_linear, "time_kernels", timing)
    first = onednn_linear.choose("auto", fp32_llama)
    assert len(timings) == 1 and first.times is planted
    (kept,) = (tmp_path / "times").glob("*.json")
    again = onednn_linear.choose("auto", fp32_llama)  # a restart: read, not timed
    assert len(timings) == 1
    assert again.onednn_from == first.onednn_from == 4 and again.times.torch == planted.torch
    assert again.times.panels == planted.panels and again.times.linear_bytes == 7
    assert f"kept in {kept}" in again.summary() and "timed 20" in again.summary()

    # What the times depend on: another checkpoint of the same shapes, other threads, other rows
    other = copy.deepcopy(fp32_llama)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(2)
    onednn_linear.choose("auto", other)
    assert len(timings) == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        onednn_linear.choose("auto", fp32_llama)
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == 3
    onednn_linear.remembered_times(fp32_llama, lambda n: None, rows=(1, 2))
    assert len(timings) == 4 and timings[-1] == (1, 2)

    # A damaged file is timed around and replaced; with the directory set to "" nothing is kept or read
    kept.write_text("{not json")
    onednn_linear.choose("auto", fp32_llama)
    assert len(timings) == 5 and "torch" in kept.read_text()
    monkeypatch.setenv(onednn_linear.TIMES_DIR_ENV, "")
    onednn_linear.choose("auto", fp32_llama)
    onednn_linear.choose("auto", fp32_llama)
    assert len(timings) == 7


def test_a_kept_timing_is_read_after_waiting_for_anothers(fp32_llama, monkeypatch, tmp_path):
    """Two stubs loading the same model at once time it once: the second waits on the machine's timing
    lock, and finds the first's times kept when it gets it."""
    monkeypatch.setenv(onednn_linear.TIMES_DIR_ENV, str(tmp_path))
    planted = onednn_linear.KernelTimes({1: 1.0}, {1: 2.0}, 7)
    key = onednn_linear.timing_key(fp32_llama, (1,))
    real_alone, kept = onednn_linear._timing_alone, []

    def alone():  # the other stub keeps its times while this one waits for the lock
        path = tmp_path / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")
        path.write_text(json.dumps({"key": key, "timed_at": "then", "times": planted.to_json()}))
        kept.append(path)
        return real_alone()

    monkeypatch.setattr(onednn_linear, "_timing_alone", alone)
    forwards = []
    times = onednn_linear.remembered_times(fp32_llama, forwards.append, rows=(1,))
    assert kept and not forwards  # not timed
    assert times.torch == {1: 1.0} and times.remembered == f"timed then, kept in {kept[0]}"
