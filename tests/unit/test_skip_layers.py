"""The layer-skip self-draft (engine/skip_layers.py) and its search (decoding/skip_search.py): the forward
equals the target's own forward with those layers removed (float64, both executors), sequences keep the set
they started with, the search finds a known-best set, and the confidence stop never changes an output."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.decoding.sampling import SamplingParams, stops_after, token_probability
from specdec.decoding.skip_search import SkipSearch, estimated_speedup, relative_cost
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import Step
from specdec.engine.skip_layers import SkipTuner, agreement, check_skip, parse_layers

LAYERS = 8
IDLE = (2, 4, 5)  # layers made to add nothing to the residual stream: skipping exactly these is free


def deep_llama(seed: int = 0, idle: tuple[int, ...] = ()) -> LlamaForCausalLM:
    """A float64 llama of LAYERS layers; the `idle` ones have zero output projections (identity layers)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for i in idle:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    return model


def without(model, skip: tuple[int, ...]) -> LlamaForCausalLM:
    """The reference: a separate model whose layer list lacks `skip` (transformers' own forward)."""
    short = copy.deepcopy(model)
    short.model.layers = torch.nn.ModuleList([layer for i, layer in enumerate(short.model.layers) if i not in skip])
    for index, layer in enumerate(short.model.layers):
        layer.self_attn.layer_idx = index
    short.config.num_hidden_layers = len(short.model.layers)
    return short


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def model():
    return deep_llama()


def test_parse_layers_takes_lists_and_ranges_and_refuses_the_ends():
    assert parse_layers("3, 5,1-2", 8) == (1, 2, 3, 5)
    assert parse_layers("", 8) == ()
    with pytest.raises(ValueError, match=r"layers \[0, 7\] cannot be skipped"):
        parse_layers("0,7", 8)
    with pytest.raises(ValueError, match="'x' is not a layer"):
        parse_layers("x", 8)
    assert check_skip((6, 1, 1), 8) == (1, 6)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_skip_forward_equals_the_model_without_those_layers(model, kind):
    skip = (1, 3, 6)
    short = without(model, skip)
    if kind == "dynamic":
        lm = dynamic_executor(model, skip_layers=skip)
    else:
        lm = static_executor(model, kv_pool_tokens=512, block_size=8, max_context=128, max_batch=4, max_rows=5,
                             min_window=16, compile="off", prefix_caching=False, skip_layers=skip)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (21,), generator=gen).tolist()
    got = lm.extend(1, 0, ids[:13], 13)
    assert torch.allclose(got, reference_logits(short, ids[:13]), atol=1e-10)
    # a rollback of two, then four more tokens: the cache holds the kept layers' keys and values
    got = lm.extend(1, 11, ids[11:15], 4)
    assert torch.allclose(got, reference_logits(short, ids[:15])[11:], atol=1e-10)
    # the whole model differs: the skip is real
    assert not torch.allclose(got, reference_logits(model, ids[:15])[11:], atol=1e-3)


def executor_of(model, kind, skip):
    if kind == "dynamic":
        return dynamic_executor(model, skip_layers=skip)
    return static_executor(model, kv_pool_tokens=1024, block_size=8, max_context=128, max_batch=4, max_rows=5,
                           min_window=16, compile="off", skip_layers=skip)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_sequences_keep_the_set_they_started_with_in_a_shared_batch(model, kind):
    lm = executor_of(model, kind, (1, 3))
    first, second = without(model, (1, 3)), without(model, (2, 5, 6))
    a, b = list(range(5, 17)), list(range(30, 40))
    lm.extend(1, 0, a, 1)
    lm.forward.set_skip((2, 5, 6))  # sequence 2 starts under the new set; sequence 1 keeps its own
    lm.extend(2, 0, b, 1)
    out = lm.extend_many([Step(1, len(a), [7, 8], 2), Step(2, len(b), [9], 1)])
    assert torch.allclose(out[0], reference_logits(first, a + [7, 8])[-2:], atol=1e-10)
    assert torch.allclose(out[1], reference_logits(second, b + [9])[-1:], atol=1e-10)


def test_agreement_is_one_for_idle_layers_and_lower_for_working_ones():
    model = deep_llama(idle=IDLE)
    ids = list(range(3, 60))
    assert agreement(model, ids, IDLE) == 1.0
    assert agreement(model, ids, (1, 3, 6)) < 0.9


def test_estimated_speedup_and_cost():
    assert relative_cost(8, 8, 2.0) == 1.0 and relative_cost(4, 8, 0.0) == 0.5
    assert estimated_speedup(1.0, 0.25, 4) == pytest.approx(5 / 2)  # k = 4: 5 tokens for 1 + 4 x 0.25
    assert estimated_speedup(0.0, 0.5, 4) < 1.0  # a draft never accepted only costs


def test_search_on_a_synthetic_objective_finds_the_best_set_deterministically():
    # agreement falls with each skipped layer outside {2, 3, 7}; skipping those is free
    free = {2, 3, 7}

    def alpha(skip):
        return 0.95 ** len(set(skip) - free) * (0.5 if set(skip) - free else 1.0)

    runs = []
    for _ in range(2):
        search = SkipSearch(10, fixed=1.0, k_max=6, seed=5)
        for _ in range(80):
            search.text_changed()
            search.report(search.candidate(), alpha(search.best))  # the incumbent
            skip = search.candidate()
            search.report(skip, alpha(skip))
        runs.append(search.best)
    assert runs[0] == runs[1] == (2, 3, 7)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_the_tuner_finds_the_idle_layers_on_live_text(kind):
    model = deep_llama(idle=IDLE)
    lm = executor_of(model, kind, ())
    tuner = SkipTuner(lm, lm.forward, k_max=6, seed=1, context=48, min_context=16, trials_per_text=6)
    assert not tuner.trial()  # no live sequence yet: nothing to measure
    gen = torch.Generator().manual_seed(7)
    lm.extend(1, 0, torch.randint(0, 97, (40,), generator=gen).tolist(), 1)
    lm.propose(1, 40, [5], 4, SamplingParams())  # drafted tokens join the known text
    assert len(lm.sequences[1].tokens) == lm.cached_length(1)
    for _ in range(70):
        tuner.trial()
    assert tuner.search.best == IDLE
    assert lm.forward.skip == IDLE  # new sequences draft with it
    lm.extend(2, 0, [1, 2, 3], 1)
    assert lm.sequences[2].skip == IDLE and lm.sequences[1].skip == ()


def test_the_tuner_goes_on_over_the_last_text_when_no_new_one_comes():
    """A draft the orchestrator keeps paused is called rarely, and its sequences end: the warm trials go on
    over the last text measured (the served tuner runs them on idle seconds too), never over none."""
    model = deep_llama(idle=IDLE)
    lm = executor_of(model, "dynamic", ())
    tuner = SkipTuner(lm, lm.forward, k_max=6, seed=1, context=48, min_context=16, trials_per_text=4, warm_trials=20)
    lm.extend(1, 0, torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(7)).tolist(), 1)
    tuner.trial()
    lm.release(1)
    assert tuner.warming
    for _ in range(30):
        tuner.trial()
    assert tuner.search.trials >= 20 and not tuner.warming and tuner.search.best == IDLE
    fresh = SkipTuner(lm, lm.forward, k_max=6, seed=1, context=48, min_context=16)
    assert not fresh.trial() and fresh.search.trials == 0  # never a text: nothing to measure


def test_the_search_scores_sets_with_the_verify_costs_it_measured():
    """A verify of k + 1 positions priced at one step promised 0.93x where the rounds gave 0.70-0.85x (a
    5-row verify costs about two steps on a 2-core CPU): the tuner measures it on the draft's copy of the
    whole model, on a scratch sequence, before its first trial, and the score uses it."""
    assert estimated_speedup(1.0, 0.25, 2, verify=(1.5, 2.0)) == pytest.approx(max(2 / 1.75, 3 / 2.5))
    assert estimated_speedup(0.5, 0.1, 3, verify=(1.2,)) == pytest.approx(
        max(1.5 / 1.3, 1.75 / 1.2, 1.875 / 1.3))  # past the measured ones a verify costs a step
    model = deep_llama(idle=IDLE)
    lm = executor_of(model, "dynamic", ())
    lines = []
    tuner = SkipTuner(lm, lm.forward, k_max=10, seed=1, context=48, min_context=16, scratch_sequence=99,
                      log=lines.append)
    lm.extend(1, 0, torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(7)).tolist(), 1)
    tuner.trial()
    verify = tuner.search.verify
    assert len(verify) == 10 and all(v > 0 for v in verify)
    assert verify[8:] == pytest.approx([verify[7] + max(0.0, verify[7] - verify[6]) * j for j in (1, 2)])
    assert set(lm.sequences) == {1} and lm.forward.skip == ()  # the scratch sequence gone, the set restored
    assert any("a verify of 2 positions" in line for line in lines)
    cost = relative_cost(lm.forward.layers - len(IDLE), lm.forward.layers, tuner.search.fixed)
    assert tuner.search.score(IDLE, 0.8) == pytest.approx(estimated_speedup(0.8, cost, 10, verify))
    broken = SkipTuner(lm, lm.forward, k_max=4, seed=1, context=48, min_context=16, scratch_sequence=98,
                       log=lines.append)
    extend = lm.extend
    lm.extend = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("no room"))
    try:
        broken.trial()  # the measurement fails: logged, the search priced as before, and it goes on
    finally:
        lm.extend = extend
    assert broken.search.verify == () and broken.scratch_sequence is None and len(broken.search.tried) == 1
    assert any("could not be measured (RuntimeError: no room)" in line for line in lines)
    tuner.search.verify = (3.0,) * 10  # dear verifies: the same set scores lower
    assert tuner.search.score(IDLE, 0.8) == pytest.approx(estimated_speedup(0.8, cost, 10, (3.0,) * 10))
    assert tuner.search.score(IDLE, 0.8) < estimated_speedup(0.8, cost, 10)


def test_token_probability_and_the_stop_rule():
    logits = torch.tensor([0.0, 0.0, 2.0])
    p = torch.softmax(logits, -1)
    assert float(token_probability(logits, torch.tensor([2]))) == pytest.approx(float(p[2]))
    assert stops_after(0.2, 0.3) and not stops_after(0.3, 0.3) and not stops_after(0.0, 0.0)


def test_confidence_stop_drafts_a_prefix_of_the_full_proposal(model):
    full, stopped = dynamic_executor(model), dynamic_executor(model)
    stopped.stop_below = 0.6
    gen = torch.Generator().manual_seed(11)
    shorter = 0
    for seq in range(1, 9):
        prompt = torch.randint(0, 97, (9,), generator=gen).tolist()
        a = full.propose(seq, 0, prompt, 6, SamplingParams())
        b = stopped.propose(seq, 0, prompt, 6, SamplingParams())
        assert 1 <= len(b.tokens) <= 6 and b.tokens == a.tokens[:len(b.tokens)]
        assert b.cached_length == len(prompt) + len(b.tokens) - 1
        # it stopped exactly after the first token the draft gave less than 0.6 (and no earlier)
        logits = reference_logits(model, prompt + a.tokens)[len(prompt) - 1:]
        probs = [float(torch.softmax(row, -1)[t]) for row, t in zip(logits, a.tokens)]
        unsure = [i for i, q in enumerate(probs) if q < 0.6]
        assert len(b.tokens) == (unsure[0] + 1 if unsure else 6)
        shorter += len(b.tokens) < 6
    assert shorter >= 2  # the threshold bites on this model


def test_the_swift_bench_runs_and_every_setting_is_exact(tmp_path):
    """`bench/swift_bench.py` on a 4-layer tiny target: every row's text equals target-only's."""
    from bench import swift_bench

    out = tmp_path / "swift.md"
    assert swift_bench.main(["--pair", "tiny-deep", "--prompts", "1", "--max-tokens", "40", "--search-prompts", "1",
                             "--warm-trials", "4", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert len(rows) == 2 * 5 and all(row.rstrip(" |").endswith("1/1") for row in rows)
    assert "layer sets measured" in out.read_text()


def test_on_the_cpu_kernels_a_searched_draft_runs_on_the_static_forward_with_a_set_per_sequence():
    """executor auto, float32 on the CPU's kernels: the layer-skip draft is the static forward eagerly, a set
    per sequence (no prefix caching), its logits the model's without those layers up to float32 rounding."""
    from specdec.engine import kernels
    from specdec.engine.build import ExecutorConfig, build_executor
    from specdec.engine.skip_layers import LayerSkipForward
    from specdec.engine.static_forward import StaticForward

    if kernels.cpu(torch.device("cpu"), torch.float32) is None:
        pytest.skip("the CPU kernels did not build")
    model = deep_llama(seed=2).float()
    lm = build_executor(model, ExecutorConfig(skip_layers=(1, 3), kv_pool_tokens=1024, block_size=8, max_context=128,
                                              max_batch=4, max_rows=5, min_window=16))
    assert isinstance(lm.forward, LayerSkipForward) and isinstance(lm.forward.inner, StaticForward)
    assert lm.kv.prefix is None
    first, second = without(model, (1, 3)), without(model, (2, 5, 6))
    a, b = list(range(5, 17)), list(range(30, 40))
    assert torch.allclose(lm.extend(1, 0, a, 3), reference_logits(first, a)[-3:], atol=1e-4)
    lm.forward.set_skip((2, 5, 6))
    lm.extend(2, 0, b, 1)
    out = lm.extend_many([Step(1, len(a) - 1, [a[-1], 7, 8], 3), Step(2, len(b), [9], 1)])  # a rollback of one
    assert torch.allclose(out[0], reference_logits(first, a + [7, 8])[-3:], atol=1e-4)
    assert torch.allclose(out[1], reference_logits(second, b + [9])[-1:], atol=1e-4)
    assert lm.forward.inner.llama.run_layers == tuple(range(LAYERS))  # every layer again outside a forward


class _Logger:
    def __init__(self):
        self.lines = []

    def log_info(self, message):
        self.lines.append(message)

    log_warn = log_info


@pytest.mark.parametrize("compile_mode", ["auto", "off"])
def test_a_searched_skip_draft_served_with_compile_auto_searches_with_a_set_per_sequence(tmp_path, compile_mode):
    """draft_model's adapter, skip_layers auto, compile auto (a GPU's default) or off: it loads (once refused:
    graphs hold one set) with a set per sequence, and the tuner searches; on the CPU no graphs are held."""
    from types import SimpleNamespace

    from specdec.engine.skip_layers import LayerSkipForward
    from specdec.triton.config import ModelParameters
    from specdec.triton.language_models import DraftModel

    deep_llama(seed=2).float().save_pretrained(tmp_path / "target")
    adapter = DraftModel.__new__(DraftModel)  # its executor's choice only: no Triton stub here
    adapter.name, adapter.pb = "swift", SimpleNamespace(Logger=_Logger())
    values = {"model_path": str(tmp_path / "target"), "draft_kind": "skip", "skip_layers": "auto",
              "compile": compile_mode, "max_num_draft_tokens": "4", "max_sequences": "4", "kv_pool_tokens": "1024"}
    params = ModelParameters({"name": "swift", "parameters": {k: {"string_value": v} for k, v in values.items()}})
    lm = adapter._executor(params, "cpu")
    assert isinstance(lm.forward, LayerSkipForward) and adapter.tuner is not None
    assert lm.forward.graph_skip is None and lm.kv.prefix is None
    logged = [line for line in adapter.pb.Logger.lines if "searching the layers to skip" in line]
    assert len(logged) == 1 and "CUDA graphs" not in logged[0]


class _FrozenCapture:
    """What capturing a CUDA graph does to a forward, on the CPU: it runs the layers that ran when it was
    captured, whatever runs later, over its static inputs (which StaticForward's one copy fills)."""

    def __init__(self, llama, shape, scratch, head_rows):
        from specdec.engine.llama_forward import Batch
        b, t, blocks = shape
        size = Batch.size(b, t, blocks)
        self.flat = torch.zeros(size + b * t, dtype=torch.long)
        self.inputs = Batch.view(self.flat, b, t, blocks)
        self.inputs.clear(scratch)
        self.llama, self.layers = llama, llama.run_layers
        self.head = self.flat[size:size + head_rows] if head_rows else None

    def run(self):
        now, self.llama.run_layers = self.llama.run_layers, self.layers
        try:
            return self.llama(self.inputs) if self.head is None else self.llama(self.inputs, head_rows=self.head)
        finally:
            self.llama.run_layers = now


def test_a_searched_drafts_graphs_follow_the_set_chosen_and_older_sets_run_eagerly(model, monkeypatch):
    """skip_search with CUDA graphs (StaticForward.graph_skip; the capture stood in for by one that freezes
    the layers as a graph does): sequences on the set the graphs hold replay them, the tuner's new set moves
    the graphs (hold_graphs: captured again for it on first use), sequences on the older set run eagerly; every
    logit the model's without that sequence's layers (float64), through rollbacks."""
    from specdec.engine.skip_layers import LayerSkipForward

    lm = static_executor(model, kv_pool_tokens=1024, block_size=8, max_context=128, max_batch=4, max_rows=5,
                         min_window=16, compile="off", skip_layers=(1, 3), skip_search=True)
    forward = lm.forward
    assert isinstance(forward, LayerSkipForward) and forward.graph_skip is None  # eager on a CPU
    inner = forward.inner
    inner.mode, inner.graph_skip = "graphs", (1, 3)  # as built on CUDA
    captures = []

    def capture(shape):
        captures.append(inner.llama.run_layers)
        return _FrozenCapture(inner.llama, shape, inner.pool.scratch, 0)
    monkeypatch.setattr(inner, "_capture", capture)
    kept = {skip: tuple(i for i in range(LAYERS) if i not in skip) for skip in ((1, 3), (2, 5, 6))}
    first, second = without(model, (1, 3)), without(model, (2, 5, 6))
    a, b = list(range(5, 17)), list(range(30, 40))
    assert torch.allclose(lm.extend(1, 0, a, 2), reference_logits(first, a)[-2:], atol=1e-10)  # a prompt: eager
    assert torch.allclose(lm.extend(1, len(a), [7, 8], 2), reference_logits(first, a + [7, 8])[-2:], atol=1e-10)
    assert captures and set(captures) == {kept[1, 3]}
    replayed = len(captures)

    forward.set_skip((2, 5, 6))  # what the tuner does with a better set
    forward.hold_graphs((2, 5, 6))
    assert forward.graph_skip == (2, 5, 6) and not inner.captured
    lm.extend(2, 0, b, 1)
    out = lm.extend_many([Step(1, len(a) + 1, [8, 9], 2), Step(2, len(b), [10, 11], 2)])  # 1: a rollback of one
    assert torch.allclose(out[0], reference_logits(first, a + [7, 8, 9])[-2:], atol=1e-10)
    assert torch.allclose(out[1], reference_logits(second, b + [10, 11])[-2:], atol=1e-10)
    assert set(captures[replayed:]) == {kept[2, 5, 6]}  # the older set never captured again, never replayed
    for _ in range(3):
        out = lm.extend_many([Step(2, len(b) + 2, [12], 1)])
    assert torch.allclose(out[0], reference_logits(second, b + [10, 11, 12])[-1:], atol=1e-10)
    assert inner.llama.run_layers == tuple(range(LAYERS))
    with pytest.raises(ValueError, match="graphs hold theirs"):
        inner.graph_skip = None
        with inner.skipping((2,)):
            pass
