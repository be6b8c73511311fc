"""The static executor (paged pool, bucketed shapes) computes what the dynamic one does: every bucket,
several sequences at different lengths, rollbacks, windows and blocks crossed; the budget refuses
cleanly. CUDA-graph capture of the same buckets is compared in tests/gpu."""

import math
import re

import pytest
import torch

from specdec.decoding.sampling import SamplingParams, make_generator
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import CacheError, CapacityError, Step
from specdec.engine.llama_forward import supports
from specdec.engine.static_forward import EAGER_FORWARD_ROWS, bucket, buckets, padded_groups


def static(model, **settings):
    # Prefix caching off unless a test is about it: these tests count the pool's free blocks.
    options = dict(kv_pool_tokens=1024, block_size=8, max_context=256, max_batch=4, max_rows=5, min_window=16,
                   compile="off", prefix_caching=False)
    return static_executor(model, **{**options, **settings})


def test_buckets_double_up_to_the_limit():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(17) == [1, 2, 4, 8, 16, 17]
    assert bucket(3, [1, 2, 4]) == 4 and bucket(5, [1, 2, 4]) is None


def run_every_bucket(reference, paged, atol: float) -> None:
    """B sequences x T rows for every bucket (and between buckets: padded rows and padded sequences),
    sequences of different lengths crossing blocks (8) and windows (16, 32, 64, ... tokens), with a
    rollback of rejected rows before each step: `paged` gives `reference`'s logits throughout."""
    assert paged.forward.batch_sizes == [1, 2, 4] and paged.forward.row_sizes == [1, 2, 4, 5]
    assert paged.forward.window_sizes == [2, 4, 8, 16, 32]
    gen = torch.Generator().manual_seed(1)
    lengths = {}
    for seq, size in enumerate([3, 7, 15, 30, 33], 1):  # 5 sequences: more than max_batch (two forwards)
        prompt = torch.randint(0, 97, (size,), generator=gen).tolist()
        a, b = reference.extend(seq, 0, prompt, 2), paged.extend(seq, 0, prompt, 2)
        assert torch.allclose(a, b, atol=atol), (a - b).abs().max()
        lengths[seq] = size
    windows_seen = set()
    for sequences in range(1, 6):
        for rows in range(1, 6):
            steps = []
            for seq in range(1, sequences + 1):
                count = max(1, rows - (seq % 2))  # neighbours with fewer rows: padding inside the bucket
                keep = max(1, lengths[seq] - (seq + rows) % 3)  # roll back 0-2 rejected tokens
                new = torch.randint(0, 97, (count,), generator=gen).tolist()
                steps.append(Step(seq, keep, new, num_logits=count))
                lengths[seq] = keep + count
            windows_seen |= {bucket(-(-lengths[s] // 8), paged.forward.window_sizes) for s in range(1, sequences + 1)}
            for a, b in zip(reference.extend_many(steps), paged.extend_many(steps)):
                assert not isinstance(b, CacheError)
                assert torch.allclose(a, b, atol=atol), (sequences, rows, (a - b).abs().max())
    assert {paged.cached_length(s) for s in lengths} == {reference.cached_length(s) for s in lengths}
    assert windows_seen >= {2, 4, 8}  # 16, 32 and 64-token windows all used


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_bucket_with_rollbacks_matches_the_dynamic_executor(tiny_lm, prefix_caching):
    paged = static(tiny_lm, prefix_caching=prefix_caching)
    paged.forward.llama.reserve_workspace(4 * 32)  # the gather buffers the CUDA graphs share
    run_every_bucket(dynamic_executor(tiny_lm), paged, atol=1e-10)


def test_compiled_kernels_match_eager_in_every_bucket_and_compile_only_at_load(tiny_lm):
    """The fused pointwise kernels (torch.compile, as CUDA graphs capture them on a GPU; here inductor's
    CPU code) give the eager forward's logits in every bucket, up to the rounding of the norm's float32
    arithmetic (which this float64 model, like transformers', does in float32; carried along in the KV
    cache); and everything compiles
    when they are made: a compile during a CUDA graph capture would break it."""
    from torch._dynamo.utils import counters

    from specdec.engine import kernels

    paged = static(tiny_lm, fuse_kernels=True)
    assert paged.forward.llama.kernels is not kernels.EAGER and all(f is not None for f in paged.forward.llama.qkv)
    compiles = counters["stats"]["unique_graphs"]
    run_every_bucket(static(tiny_lm), paged, atol=1e-4)  # measured: at most 3e-5 on logits up to 10
    assert counters["stats"]["unique_graphs"] == compiles


def test_a_new_process_loads_the_kernels_from_inductors_cache(tiny_lm):
    """What a new server (a new pod) does where the compile cache outlives the last one: it compiles
    nothing. Here a reset of dynamo and of inductor's in-process caches stands for the new process; what
    remains is the on-disk cache, which the first load filled (or an earlier test did). The load says so."""
    import torch._dynamo
    from torch._inductor.utils import clear_caches

    static(tiny_lm, fuse_kernels=True)
    torch._dynamo.reset()
    clear_caches()
    logs = []
    static(tiny_lm, fuse_kernels=True, log=logs.append)
    (line,) = [line for line in logs if line.startswith("fused kernels")]
    loaded = int(re.search(r"0 compiled, (\d+) loaded; inductor's cache in \S+\)$", line).group(1))
    assert loaded >= 4, line  # at least one graph per kernel function


def test_the_fused_mlp_matches_the_models_own_in_every_bucket_eager_and_compiled(tiny_lm):
    """fuse_mlp: one gate/up product and silu(gate) * up give transformers' MLP to float64 rounding
    eagerly, and with the compiled kernels what the compiled kernels give without it."""
    paged = static(tiny_lm, fuse_mlp=True)
    assert all(f is not None for f in paged.forward.llama.gate_up)
    run_every_bucket(dynamic_executor(tiny_lm), paged, atol=1e-10)
    from torch._dynamo.utils import counters

    fused, reference = static(tiny_lm, fuse_kernels=True, fuse_mlp=True), static(tiny_lm, fuse_kernels=True)
    assert all(f is not None for f in fused.forward.llama.gate_up)
    compiles = counters["stats"]["unique_graphs"]
    run_every_bucket(reference, fused, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == compiles  # silu_mul compiled at load too


def test_the_mlp_is_fused_by_default_only_where_cuda_graphs_run(tiny_lm):
    """fuse_mlp None (the served default) fuses with CUDA graphs only: eager forwards (here, CPU) keep the
    model's own MLP module; an explicit False keeps it everywhere."""
    assert static(tiny_lm).forward.llama.gate_up == [None, None]
    assert static(tiny_lm, fuse_mlp=False).forward.llama.gate_up == [None, None]


def test_linears_fuse_only_where_the_module_has_them_all():
    """A SiLU MLP of another layout (no gate_proj) is left to its own module, not an AttributeError."""
    from specdec.engine.llama_forward import fuse_linears

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(4, 8, bias=False)

    assert fuse_linears(Mlp(), ("gate_proj", "up_proj")) is None


def test_a_non_silu_mlp_is_left_to_the_model(tiny_lm):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**tiny_lm.config.to_dict(), "hidden_act": "gelu"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    paged = static(model, fuse_mlp=True)
    assert paged.forward.llama.gate_up == [None, None]
    a, b = dynamic_executor(model).extend(1, 0, [3, 5, 7], 3), paged.extend(1, 0, [3, 5, 7], 3)
    assert torch.allclose(a, b, atol=1e-10)


def test_a_prompt_longer_than_the_buckets_runs_beside_bucketed_steps(tiny_lm):
    dynamic, paged = dynamic_executor(tiny_lm), static(tiny_lm)
    for lm in (dynamic, paged):
        lm.extend(1, 0, [4, 5, 6], 1)
    steps = [Step(1, 3, [7], 1), Step(2, 0, list(range(1, 41)), 3)]  # 40 rows > max_rows: eager
    for a, b in zip(dynamic.extend_many(steps), paged.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-10)


def test_padded_groups_split_a_batch_where_padding_costs_more_than_a_forward():
    assert padded_groups({0: 1, 1: 1, 2: 1}, 8, 4) == [[0, 1, 2]]  # alike: one forward
    assert padded_groups({0: 9, 1: 1, 2: 1, 3: 1, 4: 1}, 8, 4) == [[1, 2, 3, 4], [0]]  # 45 padded rows > 4 + 9 + 4
    assert padded_groups({0: 2, 1: 1, 2: 1}, 8, 4) == [[1, 2, 0]]  # 3 padded rows < one more forward
    assert padded_groups({i: 1 for i in range(5)}, 2, 4) == [[0], [1, 2], [3, 4]]  # at most `most` a forward
    assert padded_groups({}, 8, 4) == []


def test_an_eager_cpu_batch_of_mixed_lengths_runs_as_the_forwards_that_cost_least(tiny_lm):
    """One sequence verifying 5 rows beside three one-row steps: two forwards (5 rows, and 3 x 1) instead of
    one padding all four to 5 rows, the logits the dynamic executor's."""
    dynamic, paged = dynamic_executor(tiny_lm), static(tiny_lm)
    for lm in (dynamic, paged):
        for seq in range(4):
            lm.extend(seq, 0, [4 + seq, 5, 6, 7], 1)
    shapes = []
    forward_group = paged.forward._forward_group

    def counted(seqs, rows, num_logits, trees):
        shapes.append(sorted(len(row) for row in rows))
        return forward_group(seqs, rows, num_logits, trees)
    paged.forward._forward_group = counted
    steps = [Step(0, 4, [8], 1), Step(1, 4, [9, 10, 11, 12, 13], 5), Step(2, 4, [14], 1), Step(3, 3, [7], 1)]
    for a, b in zip(dynamic.extend_many(steps), paged.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-10)
    assert sorted(shapes) == [[1, 1, 1], [5]] and EAGER_FORWARD_ROWS < 3 * 4


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20)])
def test_proposals_match_the_dynamic_executor(tiny_lm, params):
    dynamic, paged = dynamic_executor(tiny_lm), static(tiny_lm)
    results = []
    for lm in (dynamic, paged):
        steps = [Step(seq, 0, [seq, 9, 12, 40][:seq + 1], k=k, params=params,
                      generator=None if params.greedy else make_generator(seq, lm.logits_device))
                 for seq, k in ((1, 3), (2, 5), (3, 1))]
        first = lm.propose_many(steps)
        second = lm.propose(1, 4, [first[0][0][0], 77], 4, params,
                            None if params.greedy else make_generator(5, lm.logits_device))
        results.append((first, second))
    (first_d, second_d), (first_p, second_p) = results
    for (tokens_d, probs_d, *_), (tokens_p, probs_p, *_) in zip(first_d + [second_d], first_p + [second_p]):
        assert tokens_d == tokens_p
        assert (probs_d is None) == (probs_p is None)
        if probs_d is not None:
            assert torch.allclose(probs_d, probs_p, atol=1e-10)


def test_the_budget_refuses_a_sequence_cleanly_and_frees_on_release(tiny_lm):
    paged = static(tiny_lm, kv_pool_tokens=48, max_context=32)  # 6 blocks of 8 tokens
    paged.extend(1, 0, list(range(1, 21)), 1)  # 3 blocks
    paged.extend(2, 0, list(range(1, 17)), 1)  # 2 blocks: 1 left
    held = paged.kv_bytes_allocated
    with pytest.raises(CacheError, match="KV cache budget full.*kv_pool_tokens=48"):
        paged.extend(3, 0, list(range(1, 12)), 1)  # needs 2
    assert 3 not in paged.sequences and paged.kv_bytes_allocated == held  # nothing kept for it
    # Growing past the budget fails that step only; the sequence keeps its tokens and its neighbour runs.
    results = paged.extend_many([Step(2, 16, list(range(1, 9)), 1), Step(1, 20, list(range(1, 13)), 1)])
    assert not isinstance(results[0], CacheError)  # took the last block
    assert isinstance(results[1], CacheError) and "budget full" in str(results[1])
    assert paged.cached_length(1) == 20 and paged.cached_length(2) == 24
    with pytest.raises(CacheError, match="33 tokens exceed the context of 32"):
        paged.extend(2, 24, list(range(9)), 1)
    assert paged.release(1)
    assert len(paged.kv.pool.free) == 3
    paged.extend(3, 0, list(range(1, 12)), 1)  # fits now
    assert paged.kv_bytes_allocated == 5 * paged.kv.pool.block_bytes


def test_a_refused_step_keeps_no_frame_alive(tiny_lm):
    """A step's error goes back without its traceback: that would hold the caller's frame (in the server,
    the adapter's requests and responses) in a reference cycle until the collector runs, and in a Python-
    backend stub the collector's last run may be at its exit, where freeing them was seen to hang."""
    import gc
    import weakref

    class Marker:
        pass

    def caller(lm):  # stands for the adapter's execute: its locals live as long as its frame
        marker = Marker()
        results = lm.extend_many([Step(3, 0, list(range(1, 12)), 1, reserve=30)])
        return weakref.ref(marker), results

    for lm in (static(tiny_lm, kv_pool_tokens=16, max_context=16), dynamic_executor(tiny_lm, max_sequences=1)):
        lm.extend(1, 0, [1, 2], 1)  # the pool (or the sequence limit) is full
        gc.disable()
        try:
            ref, results = caller(lm)
            assert isinstance(results[0], CacheError) and results[0].__traceback__ is None
            del results
            assert ref() is None  # freed by reference counting: no cycle
        finally:
            gc.enable()


def test_a_new_sequence_reserves_its_generation_up_front(tiny_lm):
    """A first step's reserve takes the blocks of the whole generation (up to the context), so growing
    into it never fails; a sequence that does not fit is refused with CapacityError and holds nothing;
    the logits are those of an unreserved step."""
    paged = static(tiny_lm, kv_pool_tokens=48, max_context=32)  # 6 blocks of 8 tokens
    plain = static(tiny_lm, kv_pool_tokens=48, max_context=32)
    logits = paged.extend(1, 0, [5, 6, 7], 1, reserve=20)  # 3 blocks now, 1 used
    assert len(paged.sequences[1].blocks) == 3 and torch.equal(logits, plain.extend(1, 0, [5, 6, 7], 1))
    with pytest.raises(CapacityError, match="KV cache budget full"):
        paged.extend(2, 0, [1, 2], 1, reserve=100)  # clamped to the context, 4 blocks: 3 are free
    assert 2 not in paged.sequences and len(paged.kv.pool.free) == 3  # nothing kept for it
    paged.extend(2, 0, [1, 2], 1, reserve=24)  # 3 blocks, none left
    with pytest.raises(CapacityError, match="KV cache budget full"):
        paged.extend(3, 0, [1], 1)
    grown = paged.extend(1, 3, list(range(1, 18)), 2, reserve=999)  # within its reservation (20); reserve ignored
    assert len(paged.sequences[1].blocks) == 3
    assert torch.allclose(grown, plain.extend(1, 3, list(range(1, 18)), 2), atol=1e-10)  # crossing blocks
    paged.release(1), paged.release(2)
    paged.extend(4, 0, [1, 2], 1, reserve=100)
    assert len(paged.sequences[4].blocks) == 4  # the context (32 tokens), not 100
    tokens = paged.propose(3, 0, [1], 2, SamplingParams(), reserve=9).tokens  # the draft side reserves too
    assert len(tokens) == 2 and len(paged.sequences[3].blocks) == 2


def test_the_sequence_limit_is_a_capacity_error(tiny_lm):
    lm = dynamic_executor(tiny_lm, max_sequences=1)
    lm.extend(1, 0, [1, 2], 1, reserve=1000)  # no budget here: the reserve takes nothing
    with pytest.raises(CapacityError, match="max_sequences"):
        lm.extend(2, 0, [1], 1)


def test_idle_eviction_returns_blocks(tiny_lm):
    now = [0.0]
    paged = static(tiny_lm, idle_timeout_s=10, clock=lambda: now[0])
    paged.extend(1, 0, [1, 2, 3], 1)
    now[0] = 11.0
    assert paged.evict_idle() == [1]
    assert len(paged.kv.pool.free) == paged.kv.pool.blocks


def test_blocks_are_zeroed_before_first_use(tiny_lm):
    """Masked keys weigh 0, but 0 x NaN is NaN: garbage in a fresh block must not reach the output."""
    paged, dynamic = static(tiny_lm), dynamic_executor(tiny_lm)
    for buffers in (paged.kv.pool.keys, paged.kv.pool.values):
        for buffer in buffers:
            buffer[:paged.kv.pool.blocks].fill_(math.nan)  # what uninitialized memory may hold
    a, b = dynamic.extend(1, 0, [3, 4, 5], 3), paged.extend(1, 0, [3, 4, 5], 3)
    assert torch.allclose(a, b, atol=1e-10)
    paged.extend(2, 0, [1], 1, reserve=40)  # 5 blocks of 8 at once: all zeroed together, no others
    taken = paged.sequences[2].blocks
    assert len(taken) == 5
    for buffer in paged.kv.pool.keys + paged.kv.pool.values:
        assert torch.isfinite(buffer[taken]).all() and buffer[paged.kv.pool.free[-1]].isnan().all()


def test_a_pool_too_small_for_one_context_is_refused_at_load(tiny_lm):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_context=256"):
        static(tiny_lm, kv_pool_tokens=100)


def test_other_model_families_are_named(tiny_lm):
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert "gpt2" in supports(other)
    with pytest.raises(ValueError, match="static executor cannot run this model: model type 'gpt2'"):
        static(other)
    assert supports(tiny_lm) is None
    with pytest.raises(ValueError, match="compile=graphs needs a CUDA device"):
        static(tiny_lm, compile="graphs")


FAMILIES = {
    "qwen2": ("Qwen2", {}),  # biases on the query/key/value projections
    "qwen3": ("Qwen3", {"head_dim": 8}),  # per-head RMSNorm of queries and keys
    "mistral": ("Mistral", {"sliding_window": None}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_other_families_match_the_dynamic_executor_eager_and_fused(family):
    """Qwen2 (fused projection with biases), Qwen3 (q/k norms inside the fused rotary) and Mistral run the
    same static forward: a prompt, then a step after rolling one token back, against transformers' own
    forward; eagerly to the last bit, with the compiled kernels to the float32 rounding of their norms."""
    import transformers

    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).to(torch.float64).eval()
    assert supports(model) is None
    for fused, atol in ((False, 1e-10), (True, 1e-4)):
        dynamic, paged = dynamic_executor(model), static(model, fuse_kernels=fused)
        assert all(f is not None for f in paged.forward.llama.qkv)  # one product each
        for keep, ids, wanted in ((0, [3, 5, 7, 9, 11, 13], 2), (5, [4, 6, 8], 3)):
            a, b = dynamic.extend(1, keep, ids, wanted), paged.extend(1, keep, ids, wanted)
            assert torch.allclose(a, b, atol=atol), (family, fused, (a - b).abs().max())


def test_prompts_in_prompt_buckets_give_the_eager_logits(tiny_lm):
    """prefill_rows: a prompt beyond the row buckets runs alone in a padded power-of-two bucket whose head
    covers only the rows wanted (K + 1 at most): the same logits as the dynamic executor, at every size
    around the buckets' edges, after a prefix of its own (a window crossed), for proposals too; a prompt
    longer than prefill_rows, or wanting more rows than the head's, still runs eagerly."""
    paged = static(tiny_lm, prefill_rows=40)
    assert paged.forward.row_sizes == [1, 2, 4, 5] and paged.forward.prefill_sizes == [8, 16, 32, 40] and paged.forward.head_rows == 5
    # what warm-up would capture: the decode buckets, then each prompt bucket in the windows (2-32 blocks of
    # 8 tokens) that can hold it
    shapes = paged.forward.bucket_shapes()
    assert len(shapes) == 3 * 4 * 5 + 5 + 5 + 4 + 3 and shapes[-1] == (1, 40, 32)
    assert (1, 16, 2) in shapes and (1, 32, 2) not in shapes
    dynamic = dynamic_executor(tiny_lm)
    gen = torch.Generator().manual_seed(3)
    for seq, (size, wanted) in enumerate([(6, 1), (8, 5), (9, 3), (16, 1), (17, 5), (33, 2), (40, 1), (41, 1),
                                          (12, 7)], 1):
        prompt = torch.randint(0, 97, (size,), generator=gen).tolist()
        a, b = dynamic.extend(seq, 0, prompt, wanted), paged.extend(seq, 0, prompt, wanted)
        assert b.shape == (wanted, a.shape[-1]) and torch.allclose(a, b, atol=1e-10), (size, (a - b).abs().max())
        # then a second long chunk after it (its keys in the pool), and a decode step: still the same
        more = torch.randint(0, 97, (20,), generator=gen).tolist()
        a, b = dynamic.extend(seq, size, more, 2), paged.extend(seq, size, more, 2)
        assert torch.allclose(a, b, atol=1e-10), (size, (a - b).abs().max())
        a, b = dynamic.extend(seq, size + 20, [5], 1), paged.extend(seq, size + 20, [5], 1)
        assert torch.allclose(a, b, atol=1e-10)
    # a draft's first call: its prompt in a bucket, then drafting from the one row of logits it wanted
    first = [lm.propose(50, 0, list(range(1, 20)), 3, SamplingParams()) for lm in (dynamic, paged)]
    assert first[0][0] == first[1][0]


def test_prompt_buckets_are_off_by_default_and_a_prompt_then_runs_eagerly_with_the_head_on_its_rows(tiny_lm):
    paged = static(tiny_lm)
    assert paged.forward.prefill_sizes == []
    calls = []
    forward = paged.forward.llama

    class Spy:
        def __getattr__(self, name):
            return getattr(forward, name)

        def __call__(self, batch, head_rows=None):
            calls.append((tuple(batch.ids.shape), None if head_rows is None else len(head_rows)))
            return forward(batch, head_rows)

    paged.forward.llama = Spy()
    a = dynamic_executor(tiny_lm).extend(1, 0, list(range(1, 24)), 2)
    assert torch.allclose(a, paged.extend(1, 0, list(range(1, 24)), 2), atol=1e-10)
    assert calls == [((1, 23), 2)]  # its own shape, eagerly, the head on the 2 rows wanted
    paged.extend(1, 23, [4, 5], 2)
    assert calls[-1] == ((1, 2), 2)  # eagerly a step is not padded to a bucket either
