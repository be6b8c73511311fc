"""LoRA adapters served over one base model (engine/lora.py): an adapted sequence computes what the model
with its adapter merged into the weights computes (float64), sequences of different adapters side by side
in one forward compute what each does alone, a prompt's cached blocks are its own adapter's, and adapters
that do not fit the model are refused naming their path."""

import copy
import json
import re

import pytest
import torch

from specdec.engine import lora, lora_config
from specdec.engine.lora_config import directory_adapter, directory_adapters, parse_adapters
from specdec.engine.build import ExecutorConfig, build_executor, dynamic_executor, static_executor
from specdec.engine.errors import CacheError, CapacityError
from specdec.engine.executor import Step


def merged(model, weights, scale):
    """A copy of model with W + scale * B @ A in every adapted linear: the adapted model, plainly."""
    copied = copy.deepcopy(model)
    for module in copied.modules():  # a forward's fused products (llama_forward.fuse_linears) made again
        for key in [key for key in module.__dict__ if key.startswith("_fused_")]:
            del module.__dict__[key]
    with torch.no_grad():
        for (layer, module), (a, b) in weights.items():
            part = lora.MODULES[module][0]
            linear = getattr(getattr(copied.model.layers[layer], part), module)
            linear.weight += scale * (b @ a).to(linear.weight.dtype)
    return copied


def executor(model, adapters=None, **settings):
    options = dict(kv_pool_tokens=1024, block_size=8, max_context=256, max_batch=4, max_rows=5, min_window=16,
                   compile="off", prefix_caching=True, lora_adapters=adapters)
    return static_executor(model, **{**options, **settings})


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def adapters(tiny_lm, tmp_path_factory):
    """Two adapters of the tiny model: every projection at rank 4 (alpha 8), and q/v only at rank 2 with rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    every = lora.random_adapter(tiny_lm, rank=4, seed=1)
    lora.save_adapter(root / "every", every, rank=4, alpha=8)
    some = lora.random_adapter(tiny_lm, rank=2, seed=2, modules=("q_proj", "v_proj"))
    lora.save_adapter(root / "some", some, rank=2, alpha=4)
    config = json.loads((root / "some" / lora.CONFIG).read_text())
    (root / "some" / lora.CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    return {"every": (str(root / "every"), every, 8 / 4), "some": (str(root / "some"), some, 4 / 2 ** 0.5)}


def test_an_adapted_sequence_computes_the_merged_model(tiny_lm, adapters):
    lm = executor(tiny_lm, {name: path for name, (path, _, _) in adapters.items()})
    ids = prompt(21)
    for slot, (name, (_, weights, scale)) in enumerate(adapters.items(), 1):
        reference = executor(merged(tiny_lm, weights, scale))
        got = lm.extend_many([Step(slot, 0, ids, 3, adapter=name)])[0]
        want = reference.extend(1, 0, ids, 3)
        assert torch.allclose(got, want, atol=1e-10), name
        # the next steps (a verify of 3 rows after a rollback) go on with the sequence's adapter
        got = lm.extend(slot, 19, [5, 6, 7], 3)
        want = reference.extend(1, 19, [5, 6, 7], 3)
        assert torch.allclose(got, want, atol=1e-10), name
    base = executor(tiny_lm).extend(1, 0, ids, 3)
    assert torch.equal(lm.extend(9, 0, ids, 3), base)  # no adapter: the base model, bit for bit
    assert not torch.allclose(base, reference.extend(2, 0, ids, 3), atol=1e-3)  # the adapters change the model


def test_sequences_of_different_adapters_in_one_forward_compute_what_each_does_alone(tiny_lm, adapters):
    names = {name: path for name, (path, _, _) in adapters.items()}
    together, alone = executor(tiny_lm, names), executor(tiny_lm, names)
    steps = [Step(i, 0, prompt(9 + i, seed=i), 2, adapter=['', 'every', 'some'][i % 3]) for i in range(4)]
    batched = together.extend_many(steps)
    for step, logits in zip(steps, batched):
        assert torch.allclose(logits, alone.extend_many([step])[0], atol=1e-12)
    # decode steps of all four in one forward, then a draft verified
    batched = together.extend_many([Step(i, 9 + i, [3, 4], 2) for i in range(4)])
    for i, logits in enumerate(batched):
        assert torch.allclose(logits, alone.extend(i, 9 + i, [3, 4], 2), atol=1e-12)


def test_a_prompt_takes_cached_blocks_of_its_own_adapter_only(tiny_lm, adapters):
    names = {name: path for name, (path, _, _) in adapters.items()}
    lm = executor(tiny_lm, names)
    ids = prompt(26)
    first = lm.extend_many([Step(1, 0, ids, 1, adapter='every')])[0]
    assert lm.prefix_hit_tokens == 0
    other = lm.extend_many([Step(2, 0, ids, 1, adapter='some')])[0]  # the same prompt, another adapter
    base = lm.extend(3, 0, ids, 1)
    assert lm.prefix_hit_tokens == 0  # neither took the first's blocks
    again = lm.extend_many([Step(4, 0, ids, 1, adapter='every')])[0]
    assert lm.prefix_hit_tokens == 24 and torch.allclose(again, first, atol=1e-12)
    assert lm.extend_many([Step(5, 0, ids, 1, adapter='some')])[0].allclose(other, atol=1e-12)
    assert lm.extend(6, 0, ids, 1).allclose(base, atol=1e-12)
    assert lm.prefix_hit_tokens == 72


def test_an_adapter_the_executor_does_not_serve_is_refused_for_that_sequence(tiny_lm, adapters):
    lm = executor(tiny_lm, {"every": adapters["every"][0]})
    bad, good = lm.extend_many([Step(1, 0, [1, 2], 1, adapter="some"), Step(2, 0, [1, 2], 1, adapter="every")])
    assert isinstance(bad, CacheError) and "no LoRA adapter 'some' (served: every)" in str(bad) and 1 not in lm.sequences
    assert good.shape == (1, 97)
    plain = executor(tiny_lm)
    assert isinstance(plain.extend_many([Step(1, 0, [1], 1, adapter="every")])[0], CacheError)


def test_adapters_need_the_static_executor(tiny_lm, adapters):
    config = ExecutorConfig(executor="dynamic", lora_adapters=(("every", adapters["every"][0]),))
    with pytest.raises(ValueError, match="LoRA adapters need the static executor"):
        build_executor(tiny_lm, config)
    assert dynamic_executor(tiny_lm).adapters is None


def test_adapters_that_do_not_fit_are_refused_naming_the_path(tiny_lm, tmp_path):
    wide = lora.random_adapter(tiny_lm, rank=2, seed=3, modules=("q_proj",))
    wide = {key: (torch.zeros(2, 48, dtype=torch.float64), b) for key, (a, b) in wide.items()}  # hidden 48, not 32
    lora.save_adapter(tmp_path / "wide", wide, rank=2, alpha=2)
    with pytest.raises(ValueError, match=r"'wide' \(.*wide\): layer 0 q_proj: lora_A \[2, 48\].*another model"):
        lora.load_adapter("wide", tmp_path / "wide", tiny_lm)
    deep = {(5, "q_proj"): lora.random_adapter(tiny_lm, rank=2, modules=("q_proj",))[(0, "q_proj")]}
    lora.save_adapter(tmp_path / "deep", deep, rank=2, alpha=2)
    with pytest.raises(ValueError, match="layer 5; the model at hand has 2 layers"):
        lora.load_adapter("deep", tmp_path / "deep", tiny_lm)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora.load_adapter("none", tmp_path / "missing", tiny_lm)
    from safetensors.torch import save_file
    lora.save_adapter(tmp_path / "head", deep, rank=2, alpha=2)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 32)},
              str(tmp_path / "head" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.lora_A.weight is not a LoRA weight of a decoder layer"):
        lora.load_adapter("head", tmp_path / "head", tiny_lm)


def test_adapter_lists_parse_or_name_the_field():
    assert parse_adapters("a=/x, b=/y", "lora_adapters") == {"a": "/x", "b": "/y"}
    assert parse_adapters('{"sql": "/m/sql"}', "lora_adapters") == {"sql": "/m/sql"}
    assert parse_adapters("", "lora_adapters") == {}
    for text, match in (("a", "NAME=DIRECTORY"), ("a=/x,a=/y", "named twice"), ("b d=/x", "letters, digits"),
                        ('{"a": 1}', "JSON object")):
        with pytest.raises(ValueError, match=f"lora_adapters: .*{match}"):
            parse_adapters(text, "lora_adapters")


@pytest.fixture(scope="module")
def library(tiny_lm, tmp_path_factory):
    """A directory of adapters (lora_directory): three of rank 2-4 at DIR/NAME, one of an owner at
    DIR/OWNER/NAME, one of rank 8, and a folder that holds no adapter; {name: (weights, scale)}."""
    root = tmp_path_factory.mktemp("library")
    found = {}
    for i, (name, rank) in enumerate((("a", 4), ("b", 2), ("c", 4), ("team/d", 3), ("wide", 8))):
        weights = lora.random_adapter(tiny_lm, rank=rank, seed=10 + i, modules=tuple(lora.MODULES)[i % 3:])
        lora.save_adapter(root / name, weights, rank=rank, alpha=2 * rank)
        found[name] = (weights, 2.0)
    (root / "notes").mkdir()
    return root, found


def test_a_directorys_adapters_are_read_when_first_named_and_the_least_recently_used_idle_one_makes_room(
        tiny_lm, library, adapters):
    root, found = library
    lm = executor(tiny_lm, {"every": adapters["every"][0]}, lora_directory=str(root), max_loras=3, max_lora_rank=4)
    held = lm.adapters
    assert len(held) == 3 and held.names == ("every",) and held.rank == 4
    ids = prompt(21)
    want = {name: executor(merged(tiny_lm, *found[name])).extend(1, 0, ids, 2) for name in ("a", "b", "c", "team/d")}

    def run(seq, name):
        out = lm.extend_many([Step(seq, 0, ids, 2, adapter=name)])[0]
        if not isinstance(out, Exception):
            assert torch.allclose(out, want[name], atol=1e-10), name
        return out

    run(1, "a")
    lm.release(1)
    run(2, "b")  # the two free slots: a's and b's
    assert held.names == ("every", "a", "b")
    run(3, "c")  # a's slot is the least recently used, and no sequence runs a
    assert held.names == ("every", "c", "b")
    # every slot runs a sequence's adapter (lora_adapters' for good): refused, retry later, nothing kept
    busy = run(4, "team/d")
    assert isinstance(busy, CapacityError) and "each of the 3 LoRA slots" in str(busy) and 4 not in lm.sequences
    lm.release(2)
    run(4, "team/d")  # b's slot now
    assert held.names == ("every", "c", "team/d") and held.loads == 4
    # sequences of every held adapter and the base model in one forward: each as alone
    # (and of the first two slots only: eagerly the products run over the slots up to the last one a row runs)
    for names in (("c", "", "team/d", "every", "c"), ("every", "c", "")):
        steps = [Step(10 + i, 0, ids, 2, adapter=name) for i, name in enumerate(names)]
        for step, logits in zip(steps, lm.extend_many(steps)):
            alone = executor(tiny_lm, {"every": adapters["every"][0]}, lora_directory=str(root), max_loras=3,
                             max_lora_rank=4).extend_many([step])[0]
            assert torch.allclose(logits, alone, atol=1e-10), step.adapter
        for step in steps:
            lm.release(step.seq_id)
    # what is not in the directory, or above max_lora_rank, or a name leaving it: refused naming it
    for name, message in (("nope", f"no LoRA adapter 'nope' \\(served: every, c, team/d; none in lora_directory {root}"),
                          ("notes", "no LoRA adapter 'notes'"), ("../library", "no LoRA adapter '../library'"),
                          ("wide", "has rank 8; max_lora_rank is 4")):
        for seq in list(lm.sequences):
            lm.release(seq)
        out = lm.extend_many([Step(20, 0, ids, 2, adapter=name)])[0]
        assert isinstance(out, CacheError) and re.search(message, str(out)), (name, out)
        assert 20 not in lm.sequences


def test_a_slot_taken_by_another_adapter_does_not_serve_the_blocks_its_earlier_adapter_computed(tiny_lm, library):
    root, found = library
    lm = executor(tiny_lm, lora_directory=str(root), max_loras=1, max_lora_rank=4)
    ids = prompt(26)
    first = lm.extend_many([Step(1, 0, ids, 1, adapter="a")])[0]
    lm.release(1)
    assert lm.extend_many([Step(2, 0, ids, 1, adapter="a")])[0].allclose(first, atol=1e-12)
    assert lm.prefix_hit_tokens == 24  # a's own blocks, found again
    lm.release(2)
    other = lm.extend_many([Step(3, 0, ids, 1, adapter="b")])[0]  # b takes a's slot
    assert lm.prefix_hit_tokens == 24  # and none of a's blocks
    assert torch.allclose(other, executor(merged(tiny_lm, *found["b"])).extend(1, 0, ids, 1), atol=1e-10)
    lm.release(3)
    again = lm.extend_many([Step(4, 0, ids, 1, adapter="a")])[0]  # a read again: a new key, b's blocks not its
    assert lm.prefix_hit_tokens == 24 and again.allclose(first, atol=1e-10)


def test_a_held_adapter_whose_entry_changed_is_read_again_and_one_whose_entry_is_gone_is_refused(tiny_lm, library,
                                                                                                   tmp_path):
    """The gateway's load_lora_adapter adds an adapter as a link in the directory, load_inplace points it
    elsewhere, unload_lora_adapter removes it: the next sequence runs what the entry holds now, a running one
    keeps the version it started with (its slot is not taken while it runs)."""
    root, found = library
    directory = tmp_path / "runtime"
    directory.mkdir()
    (directory / "x").symlink_to(root / "a")
    lm = executor(tiny_lm, lora_directory=str(directory), max_loras=2, max_lora_rank=4)
    ids = prompt(21)
    want = {name: executor(merged(tiny_lm, *found[name])).extend(1, 0, ids, 2) for name in ("a", "b")}

    def run(seq, expected):
        out = lm.extend_many([Step(seq, 0, ids, 2, adapter="x")])[0]
        if expected is not None:
            assert torch.allclose(out, want[expected], atol=1e-10), expected
        return out

    run(1, "a")
    lm.release(1)
    run(2, "a")  # held: not read again
    assert lm.adapters.loads == 1
    (directory / "y").symlink_to(root / "b")
    (directory / "y").replace(directory / "x")  # x now links to b (what load_inplace does), while 2 runs a
    run(3, "b")  # into the other slot: 2 still runs the version it started with
    assert lm.adapters.loads == 2 and lm.adapters.slots.count("x") == 1
    step = lm.extend_many([Step(2, 21, [ids[0]], 1, adapter="x")])[0]
    alone = executor(merged(tiny_lm, *found["a"]))
    alone.extend(1, 0, ids, 2)
    assert torch.allclose(step, alone.extend(1, 21, [ids[0]], 1), atol=1e-10)
    # both slots busy (2 on the old version, 3 on the new): another change has no slot until one ends
    (directory / "y").symlink_to(root / "a")
    (directory / "y").replace(directory / "x")
    out = run(4, None)
    assert isinstance(out, CapacityError), out
    lm.release(2)
    run(4, "a")
    for seq in list(lm.sequences):
        lm.release(seq)
    (directory / "x").unlink()  # gone: refused, though a slot still holds it
    out = run(5, None)
    assert isinstance(out, CacheError) and "no LoRA adapter 'x'" in str(out), out


def test_a_directory_lists_its_adapters_and_keeps_names_inside_it(library):
    root, _ = library
    assert directory_adapters(root) == ["a", "b", "c", "team/d", "wide"]
    assert directory_adapter(root, "team/d") == root / "team" / "d"
    for name in ("../library", "team/../a", "./a", "team//d", "notes", "", "a b"):
        assert directory_adapter(root, name) is None, name
    assert directory_adapters(root / "missing") == [] and directory_adapter("", "a") is None


def test_slots_and_ranks_that_cannot_hold_the_adapters_are_refused(tiny_lm, library, adapters):
    root, _ = library
    with pytest.raises(ValueError, match="max_loras=1 holds no adapter of lora_directory beside the 1 of lora_adapters"):
        executor(tiny_lm, {"every": adapters["every"][0]}, lora_directory=str(root), max_loras=1)
    with pytest.raises(ValueError, match="'every' has rank 4; max_lora_rank is 2"):
        executor(tiny_lm, {"every": adapters["every"][0]}, lora_directory=str(root), max_lora_rank=2)
    lm = executor(tiny_lm, lora_directory=str(root))  # the defaults: 4 slots of rank 16
    assert (len(lm.adapters), lm.adapters.rank, lm.adapters.names) == (lora_config.DIRECTORY_SLOTS, lora.DIRECTORY_RANK, ())


def test_rows_of_several_adapters_add_what_each_rows_own_adapter_adds(tiny_lm, adapters):
    """Rows of mixed adapters (and what a captured CUDA graph runs: every row masked to its own adapter's
    columns) add what each row's adapter alone adds to it; rows of the base model nothing."""
    lm = executor(tiny_lm, {name: path for name, (path, _, _) in adapters.items()})
    adapter_set = lm.adapters
    slots = torch.tensor([0, 1, 2, 2, 0, 1, 1])
    mixed = adapter_set.plan(slots)
    assert mixed.slot == 0 and adapter_set.plan(torch.zeros(3, dtype=torch.long)) is None
    assert adapter_set.plan(torch.ones(3, dtype=torch.long)).slot == 1
    for layer in range(2):
        for group, width in (("qkv", 32), ("o", 32), ("gate_up", 32), ("down", 64)):
            x = torch.randn(7, width, dtype=torch.float64, generator=torch.Generator().manual_seed(layer))
            y = torch.randn(7, adapter_set.stacks[layer][group][1].shape[1], dtype=torch.float64)
            got = adapter_set.add(layer, group, x, y.clone(), mixed)
            for row, slot in enumerate(slots.tolist()):
                want = y[row:row + 1].clone()
                if slot:
                    want = adapter_set.add(layer, group, x[row:row + 1], want, adapter_set.plan(slots[row:row + 1]))
                assert torch.allclose(got[row:row + 1], want, atol=1e-12), (layer, group, row)


def test_the_bench_prints_every_setting(tmp_path):
    """bench/lora_bench.py (gpu_session's `lora` part) on the tiny pair: its four rows and their columns."""
    from bench import lora_bench

    out = tmp_path / "lora.md"
    assert lora_bench.main(["--pair", "tiny", "--adapters", "2", "--rank", "2", "--reps", "1", "--turns", "1",
                            "--batch", "2", "--context", "32", "--out", str(out)]) == 0
    text = out.read_text()
    for row in ("no adapters", "base rows", "one adapter", "mixed"):
        assert f"| {row} " in text
    assert "5 rows, 2 seqs (ms)" in text
    # --on-demand: adapters read from a directory
    assert lora_bench.main(["--pair", "tiny", "--rank", "2", "--reps", "1", "--turns", "1", "--batch", "2",
                            "--context", "32", "--on-demand", "--out", str(out)]) == 0
    text = out.read_text()
    for row in ("read an adapter into a slot (ms)", "a slot's tensors (MiB)", "max_loras 2 (ms)", "max_loras 6 (ms)"):
        assert row in text, row


def test_sampled_speculation_with_an_adapter_follows_the_adapted_target(tmp_path):
    """Two tokens from an 8-token tiny llama with an adapter, the first round drafting two by the base model
    (a noisy copy), 3000 seeded runs, against the exact joint distribution of sampling the merged model token
    by token; the base model's distribution lies far outside the bound (a verify without the adapter fails)."""
    import itertools
    import math

    from specdec.decoding.loop import GenerationRequest
    from specdec.decoding.sampling import SamplingParams
    from specdec.engine.local import LocalProposer, LocalScorer

    from .conftest import noisy_copy, run_fixed_k_many, tiny_llama

    model = tiny_llama(8, seed=3, initializer_range=0.3, max_positions=64)
    weights = lora.random_adapter(model, rank=2, seed=5, std=0.4)
    lora.save_adapter(tmp_path / "a", weights, rank=2, alpha=2)
    adapted = merged(model, weights, 1.0)
    prompt = [1, 2, 3, 1]

    def joint(lm) -> dict:
        with torch.no_grad():
            first = torch.softmax(lm(torch.tensor([prompt])).logits[0, -1], -1)
            return {(a, b): float(first[a] * torch.softmax(lm(torch.tensor([prompt + [a]])).logits[0, -1], -1)[b])
                    for a, b in itertools.product(range(8), repeat=2)}
    exact, plain = joint(adapted), joint(model)
    target = static_executor(model, kv_pool_tokens=8192, block_size=8, max_context=64, max_batch=128, max_rows=3,
                             min_window=16, compile="off", lora_adapters={"a": str(tmp_path / "a")})
    proposer = LocalProposer(dynamic_executor(noisy_copy(model)))
    n = 3000
    requests = [GenerationRequest(seq_id=100 + seed, prompt_ids=prompt, max_tokens=2, lora_name="a",
                                  sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
    seen: dict = {}
    for out in run_fixed_k_many(requests, proposer, LocalScorer(target), 2):
        seen[tuple(out)] = seen.get(tuple(out), 0) + 1
    tv = 0.5 * sum(abs(seen.get(key, 0) / n - p) for key, p in exact.items())
    bound = 2 * 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values()) + 0.01
    assert tv < bound, (tv, bound)
    assert 0.5 * sum(abs(plain[key] - exact[key]) for key in exact) > 3 * bound


def _layers(model, keep: list[int]):
    """A draft made of some of `model`'s layers (a layer-skip draft model, as the default pair's)."""
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList([draft.model.layers[i] for i in keep])
    draft.config.num_hidden_layers = len(keep)
    for i, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = i
    return draft


@pytest.mark.parametrize("keep", [[0], [1]])
def test_a_draft_made_of_the_targets_layers_runs_its_adapters_on_them(tiny_lm, adapters, keep):
    """lora_layers: the draft's layer i is the target's keep[i]; it takes the adapter's weights of those
    layers only (the rest are the target's to run), and computes its own layers with the adapter merged in."""
    path, weights, scale = adapters["every"]
    draft = _layers(tiny_lm, keep)
    lm = executor(draft, {"every": path}, lora_layers=tuple(keep))
    mine = {(i, module): pair for (layer, module), pair in weights.items() for i, kept in enumerate(keep)
            if layer == kept}
    assert mine and len(mine) < len(weights)
    ids = prompt(19)
    got = lm.extend_many([Step(1, 0, ids, 2, adapter="every")])[0]
    want = executor(merged(draft, mine, scale)).extend(1, 0, ids, 2)
    assert torch.allclose(got, want, atol=1e-10)
    assert not torch.allclose(got, executor(draft).extend(1, 0, ids, 2), atol=1e-3)  # the adapter changes it
    # drafting with it: what the merged draft drafts
    drafted = lm.propose_many([Step(2, 0, ids, k=4, adapter="every")])[0]
    assert drafted.tokens == executor(merged(draft, mine, scale)).propose_many([Step(2, 0, ids, k=4)])[0].tokens


def test_an_adapter_of_none_of_a_drafts_layers_is_its_base_model_and_a_map_of_other_length_is_refused(
        tiny_lm, tmp_path):
    only_second = {key: pair for key, pair in lora.random_adapter(tiny_lm, rank=2, seed=5).items() if key[0] == 1}
    lora.save_adapter(tmp_path / "second", only_second, rank=2, alpha=2)
    draft = _layers(tiny_lm, [0])
    lm = executor(draft, {"second": str(tmp_path / "second")}, lora_layers=(0,))
    ids = prompt(17)
    assert torch.equal(lm.extend_many([Step(1, 0, ids, 2, adapter="second")])[0], executor(draft).extend(1, 0, ids, 2))
    with pytest.raises(ValueError, match="lora_layers names 2 of the target's layers; the model has 1"):
        executor(draft, {"second": str(tmp_path / "second")}, lora_layers=(0, 1))
    # the target itself (no map) still refuses an adapter of a layer it does not have
    with pytest.raises(ValueError, match="is layer 1; the model at hand has 1 layers"):
        executor(draft, {"second": str(tmp_path / "second")})


def test_a_drafts_layer_map_parses_or_names_the_field():
    from specdec.engine.lora_config import parse_layer_map

    assert parse_layer_map("", 3, "f") is None and parse_layer_map("first", 3, "f") == (0, 1, 2)
    assert parse_layer_map("0-1, 29", 3, "f") == (0, 1, 29)
    for text, message in (("0-4", "names 5 layers"), ("a", "'a' is not a layer"), ("0,0,1", "distinct"),
                          ("-1,0,1", "is not a layer")):
        with pytest.raises(ValueError, match=f"^f: .*{message}"):
            parse_layer_map(text, 3, "f")


def test_a_layer_skip_self_draft_runs_the_adapter_on_the_layers_it_keeps(tmp_path):
    """A layer-skip self-draft is the target with layers left out: with a request's adapter it computes the
    merged model with the same layers left out (eagerly: a set per sequence)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    weights = lora.random_adapter(model, rank=4, seed=7)
    lora.save_adapter(tmp_path / "every", weights, rank=4, alpha=8)
    lm = executor(model, {"every": str(tmp_path / "every")}, skip_layers=(1, 2))
    ids = prompt(23)
    got = lm.extend_many([Step(1, 0, ids, 2, adapter="every")])[0]
    want = executor(merged(model, weights, 2.0), skip_layers=(1, 2)).extend(1, 0, ids, 2)
    assert torch.allclose(got, want, atol=1e-10)
    assert not torch.allclose(got, executor(model, skip_layers=(1, 2)).extend(1, 0, ids, 2), atol=1e-3)
