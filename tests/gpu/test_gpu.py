"""On a GPU: sampling with a draft model (seeded, reproducible), greedy equality in float32, a target
spread over several GPUs, in process and through a real server. Skipped without CUDA."""

import asyncio
import json
import re

import pytest
import torch

from client import Client, GenerationParams
from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, generate
from specdec.decoding.sampling import SamplingParams, make_generator
from specdec.engine import kernels
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import CacheError, Step
from specdec.engine.loading import load_causal_lm
from specdec.engine.local import LocalProposer, LocalScorer, collect
from specdec.serving import pairs, server

# Every test here needs CUDA: marked `gpu`, skipped where torch sees no GPU (CI stays CPU-only).
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [1, 400, 2000, 37, 912, 5, 77]


@pytest.fixture(scope="module")
def tiny_pair():
    return pairs.tiny_pair()


def run(target, draft, sampling, k, max_tokens=24):
    req = GenerationRequest(seq_id=1, prompt_ids=PROMPT, max_tokens=max_tokens, sampling=sampling)
    proposer = LocalProposer(draft)
    return asyncio.run(collect(generate(req, proposer, LocalScorer(target), DraftLengthPolicy.fixed(k))))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_speculative_equals_target_only_on_the_gpu(tiny_pair, dtype):
    target = dynamic_executor(load_causal_lm(tiny_pair.target_path, "cuda", dtype))
    draft = dynamic_executor(load_causal_lm(tiny_pair.draft_paths["draft_model"], "cuda", dtype))
    alone = run(target, draft, SamplingParams(), 0)
    for k in (1, 3, 8):
        assert run(target, draft, SamplingParams(), k) == alone


def test_greedy_speculative_equals_target_only_with_the_paged_kernel_in_cuda_graphs(tiny_pair):
    """float32, target and draft on the static executor as served on a GPU (CUDA graphs, attention by the
    paged kernel): a row's attention sums in the same order in a 1-row step and in a K + 1-row verify."""
    settings = dict(kv_pool_tokens=4096, block_size=16, max_context=512, max_batch=2, max_rows=9)
    target = static_executor(load_causal_lm(tiny_pair.target_path, "cuda", "float32"), **settings)
    draft = static_executor(load_causal_lm(tiny_pair.draft_paths["draft_model"], "cuda", "float32"), **settings)
    assert target.forward.llama.attention == "paged" and target.forward.mode == "graphs"
    alone = run(target, draft, SamplingParams(), 0, max_tokens=64)
    for k in (1, 3, 8):
        assert run(target, draft, SamplingParams(), k, max_tokens=64) == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_built_modules_in_cuda_graphs_give_transformers_models_logits(tiny_pair, dtype):
    """What a served static executor loads on a GPU (llama_model's modules, no transformers model code)
    against transformers' own model, each captured in CUDA graphs: the same logits to the bit, prompts,
    steps and a verify after a rollback."""
    settings = dict(kv_pool_tokens=4096, block_size=16, max_context=512, max_batch=2, max_rows=5)
    ours = load_causal_lm(tiny_pair.target_path, "cuda", dtype, own_modules=True)
    theirs = load_causal_lm(tiny_pair.target_path, "cuda", dtype)
    assert type(ours).__name__ == "CausalLM" and type(theirs).__name__ == "LlamaForCausalLM"
    executors = [static_executor(model, **settings) for model in (ours, theirs)]
    for lm in executors:
        lm.warm_up(600)
        assert lm.forward.mode == "graphs"
    steps = [[Step(1, 0, PROMPT, 2), Step(2, 0, PROMPT[:4], 1)], [Step(1, 7, [9], 1), Step(2, 4, [5, 6, 7, 8], 4)],
             [Step(1, 6, [11, 12, 13], 3), Step(2, 6, [3], 1)]]
    for batch in steps:
        a, b = (lm.extend_many(batch) for lm in executors)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), [(x - y).abs().max() for x, y in zip(a, b)]


def test_steps_run_ahead_in_cuda_graphs_equal_the_steps_asked_for(tiny_pair):
    """engine/run_ahead.py on the GPU: a greedy step run ahead (its token taken on the device, its forward a
    replayed graph whose output the next replay overwrites) gives the logits of the step asked for, and a
    dropped one (a verify asked for instead) leaves the cache as if it had not run; float32, CUDA graphs,
    the paged kernel, against the same executor never running ahead."""
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float32")
    settings = dict(kv_pool_tokens=4096, block_size=16, max_context=512, max_batch=2, max_rows=5)
    ahead, plain = (static_executor(model, **settings) for _ in range(2))
    assert ahead.forward.mode == "graphs"
    logits = [lm.extend(1, 0, PROMPT, 1) for lm in (ahead, plain)]
    length = len(PROMPT)
    for i in range(40):
        token = logits[0][-1].argmax().reshape(1)
        assert ahead.run_ahead(1, token, int(token))
        ids = [int(token)] if i % 7 != 6 else [int(token), 5, 6]  # now and then a verify: the step is dropped
        step = Step(1, length, ids, len(ids))
        logits = [lm.extend_many([step])[0] for lm in (ahead, plain)]
        assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0), i
        assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist()
        length += len(ids)
    assert (ahead.ahead_used, ahead.ahead_dropped) == (35, 5)
    assert ahead.ahead_taken[1].seconds() > 0


def test_sampling_with_a_draft_model_on_the_gpu_is_seeded(tiny_pair):
    target = dynamic_executor(load_causal_lm(tiny_pair.target_path, "cuda", "float32"))
    draft = dynamic_executor(load_causal_lm(tiny_pair.draft_paths["draft_model"], "cuda", "float32"))
    assert draft.logits_device.type == "cuda"
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    assert run(target, draft, params, 4) == run(target, draft, params, 4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_spread_target_keeps_each_layers_cache_on_its_gpu(tiny_pair):
    model = load_causal_lm(tiny_pair.target_path, device_map="balanced", dtype="float32")
    lm = dynamic_executor(model)
    assert len({d for d in lm.kv.layer_devices}) > 1
    lm.extend(1, 0, PROMPT, 1)
    seq = lm.sequences[1]
    assert [k.device for k in seq.keys] == lm.kv.layer_devices
    reference = dynamic_executor(load_causal_lm(tiny_pair.target_path, "cuda:0", "float32"))
    assert torch.allclose(lm.extend(1, len(PROMPT), [9, 10], 2).cpu(),
                          reference.extend(1, 0, PROMPT + [9, 10], 2).cpu(), atol=1e-4)


@pytest.mark.parametrize("pipelined", [False, True])
def test_served_on_the_gpu_samples_with_a_draft_model(tmp_path, tiny_pair, pipelined):
    """The served path that failed before: draft_model sampling on CUDA (generator device, host copies);
    and the same with the models' execute pipelined (responses built on a stream of their own while the
    next forward runs)."""
    args = ["--target", tiny_pair.target_path, "--draft", tiny_pair.draft_paths["draft_model"],
            "--device", "gpu", "--dtype", "float32"]
    if pipelined:
        args += ["--set", "target_model.pipelined_execute=true", "--set", "draft_model.pipelined_execute=true"]
    own = server.start(tmp_path / "run", tmp_path / "server.log", args, ready_timeout_s=600)
    try:
        client = Client(own.grpc_url)
        sampled = GenerationParams(max_tokens=24, num_draft_tokens=4, temperature=0.8, seed=11)
        first, again = client.generate("Hello there", sampled), client.generate("Hello there", sampled)
        assert first.text == again.text and first.total_draft_tokens > 0
        greedy = [client.generate("Once upon a time", GenerationParams(max_tokens=24, num_draft_tokens=k)).text
                  for k in (0, 4)]
        assert greedy[0] == greedy[1]
        # return_log_probs: greedy rounds from target_model's greedy_log_probs (a 1-row and a 5-row forward
        # agree up to float32 rounding), sampled rounds from the logits handed over on the device.
        scored = [client.generate("Once upon a time", GenerationParams(max_tokens=24, num_draft_tokens=k,
                                                                       return_log_probs=True)) for k in (0, 4)]
        assert scored[0].text == scored[1].text == greedy[0]
        assert len(scored[0].log_probs) == len(scored[1].log_probs) == scored[0].num_output_tokens
        assert torch.allclose(torch.tensor(scored[0].log_probs), torch.tensor(scored[1].log_probs), atol=1e-3)
        sampled_scored = client.generate("Hello there", GenerationParams(max_tokens=24, num_draft_tokens=4,
                                                                         temperature=0.8, seed=11, return_log_probs=True))
        assert sampled_scored.text == first.text  # asking changes no token
        assert len(sampled_scored.log_probs) == sampled_scored.num_output_tokens
        assert all(v <= 0 for v in sampled_scored.log_probs)
        assert sampled_scored.cum_log_probs == pytest.approx(sum(sampled_scored.log_probs), abs=1e-2)
        # bad_words: bans applied to the target's logits where they live (greedy rounds then fetch them).
        from transformers import AutoTokenizer
        tokens = AutoTokenizer.from_pretrained(tiny_pair.tokenizer_path).encode(greedy[0], add_special_tokens=False)
        word = AutoTokenizer.from_pretrained(tiny_pair.tokenizer_path).decode(tokens[3:4])
        banned = [client.generate("Once upon a time", GenerationParams(max_tokens=24, num_draft_tokens=k,
                                                                       bad_words=(word,))).text for k in (0, 4)]
        assert banned[0] == banned[1] != greedy[0]
        banned_sampled = [client.generate("Hello there", GenerationParams(
            max_tokens=24, num_draft_tokens=4, temperature=0.8, seed=11, bad_words=(word,))).text for _ in range(2)]
        assert banned_sampled[0] == banned_sampled[1]
        # Penalties: applied to the target's logits where they live, on greedy and sampled rounds.
        penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
        penalised = [client.generate("Once upon a time", GenerationParams(max_tokens=24, num_draft_tokens=k,
                                                                          **penalties)).text for k in (0, 4)]
        assert penalised[0] == penalised[1] != greedy[0]
        penalised_sampled = [client.generate("Hello there", GenerationParams(
            max_tokens=24, num_draft_tokens=4, temperature=0.8, seed=11, **penalties)).text for _ in range(2)]
        assert penalised_sampled[0] == penalised_sampled[1]
        # min_p: the draft's and the target's distributions filtered alike, on the device.
        min_p = [client.generate("Hello there", GenerationParams(max_tokens=24, num_draft_tokens=4, temperature=1.0,
                                                                 seed=11, min_p=0.1)) for _ in range(2)]
        assert min_p[0].text == min_p[1].text and min_p[0].total_draft_tokens > 0
        # Structured output: the grammar's masks go to the logits on the device; greedy K=0 == K=4, a JSON
        # that parses; a sampled guided request repeats with its seed.
        from tests.unit.test_grammar import SCHEMA
        guided = [client.generate("Once upon a time", GenerationParams(max_tokens=40, num_draft_tokens=k,
                                                                       guide_type="json_schema", guide=json.dumps(SCHEMA)))
                  for k in (0, 4)]
        assert guided[0].text == guided[1].text and set(json.loads(guided[0].text)) == {"name", "age"}
        guided_sampled = [client.generate("Hello there", GenerationParams(
            max_tokens=24, num_draft_tokens=4, temperature=1.0, seed=11, guide_type="regex",
            guide="[a-z]{2,8}-[0-9]{3}")).text for _ in range(2)]
        assert guided_sampled[0] == guided_sampled[1] and re.fullmatch("[a-z]{2,8}-[0-9]{3}", guided_sampled[0])
    finally:
        own.stop()


# The captured forwards in float64 (attention through SDPA: the paged kernel serves float32 and narrower)
# and in float32 with the paged attention kernel, each against the eager SDPA forward. In float32 the two
# attentions sum in different orders: on an H200 (2026-12-04) logits of magnitude ~13 differed by up to
# 1e-4 (a few dozen ulps); a wrong mask, position or block moves them by tenths.
ATTENTIONS = [("float64", "sdpa", 1e-9), ("float32", "paged", 5e-4)]


@pytest.mark.parametrize("dtype,attention,atol", ATTENTIONS)
@pytest.mark.parametrize("fuse_mlp", [False, True])
def test_cuda_graphs_match_eager_in_every_bucket(tiny_pair, fuse_mlp, dtype, attention, atol):
    """Each (sequences, rows, window) bucket replayed as a CUDA graph gives the eager static forward's
    logits, with rollbacks, sequences of different lengths and windows crossed, the graphs'
    sequences holding reservations; with the MLP's gate/up products fused or not."""
    model = load_causal_lm(tiny_pair.target_path, "cuda", dtype)
    settings = dict(kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=4, max_rows=5, min_window=16,
                    fuse_mlp=fuse_mlp)
    eager = static_executor(model, compile="off", attention="sdpa", **settings)
    graphs = static_executor(model, compile="graphs", **settings)
    assert graphs.forward.mode == "graphs" and graphs.forward.llama.attention == attention
    # The same fused pointwise kernels both ways: what differs is the capture (fused against eager
    # kernels is tests/unit/test_static_executor.py's, on CPU).
    assert graphs.forward.llama.kernels is not kernels.EAGER
    assert all((f is not None) == fuse_mlp for f in graphs.forward.llama.gate_up)
    eager.forward.llama.kernels = graphs.forward.llama.kernels
    ready, _ = graphs.warm_up(600)
    assert ready == len(graphs.forward.batch_sizes) * len(graphs.forward.row_sizes) * len(graphs.forward.window_sizes)
    gen = torch.Generator().manual_seed(1)
    lengths = {}
    for seq, size in enumerate([3, 9, 30, 70, 200], 1):
        prompt = torch.randint(0, 1000, (size,), generator=gen).tolist()
        # The graphs' sequences take room for twice their prompt up front (zeroed in one write per buffer).
        a, b = eager.extend(seq, 0, prompt, 1), graphs.extend(seq, 0, prompt, 1, reserve=2 * size)
        assert torch.allclose(a, b, atol=max(atol, 1e-8)), (a - b).abs().max()
        lengths[seq] = size
    for sequences in range(1, 6):
        for rows in range(1, 6):
            steps = []
            for seq in range(1, sequences + 1):
                count = max(1, rows - (seq % 2))
                keep = max(1, lengths[seq] - (seq + rows) % 3)
                steps.append(Step(seq, keep, torch.randint(0, 1000, (count,), generator=gen).tolist(), count))
                lengths[seq] = keep + count
            for a, b in zip(eager.extend_many(steps), graphs.extend_many(steps)):
                assert not isinstance(b, CacheError)
                assert torch.allclose(a, b, atol=atol), (sequences, rows, (a - b).abs().max())
    tokens = [lm.propose(1, lengths[1], [5], 6, SamplingParams())[0] for lm in (eager, graphs)]
    assert tokens[0] == tokens[1]


def test_prompt_buckets_replayed_as_cuda_graphs_give_the_eager_logits(tiny_pair):
    """prefill_rows: prompts beyond the row buckets replay captured prompt buckets (one sequence, padded
    rows, the head on the rows wanted) with the eager static forward's logits (float64), captured at
    warm-up; then decode steps after them in the ordinary buckets."""
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    settings = dict(kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=4, max_rows=5, min_window=16,
                    prefill_rows=64)
    eager, graphs = static_executor(model, compile="off", **settings), static_executor(model, compile="graphs", **settings)
    eager.forward.llama.kernels = graphs.forward.llama.kernels
    assert graphs.forward.prefill_sizes == [8, 16, 32, 64]
    ready, _ = graphs.warm_up(600)
    assert ready == len(graphs.forward.bucket_shapes())  # the prompt buckets too
    prompt_shapes = {shape for shape in graphs.forward.captured if shape[1] > 5}
    assert prompt_shapes and all(shape[0] == 1 for shape in prompt_shapes)
    gen = torch.Generator().manual_seed(4)
    for seq, (size, wanted) in enumerate([(6, 1), (8, 5), (17, 3), (33, 1), (64, 5), (65, 1)], 1):
        prompt = torch.randint(0, 1000, (size,), generator=gen).tolist()
        a, b = eager.extend(seq, 0, prompt, wanted), graphs.extend(seq, 0, prompt, wanted, reserve=size + 8)
        assert torch.allclose(a, b, atol=1e-9), (size, (a - b).abs().max())
        a, b = eager.extend(seq, size, [7, 8], 2), graphs.extend(seq, size, [7, 8], 2)
        assert torch.allclose(a, b, atol=1e-9), size
    assert len(graphs.forward.captured) == ready  # nothing captured after warm-up for these


def test_hidden_states_replayed_as_cuda_graphs_equal_the_eager_forward(tiny_pair):
    """hidden_layers under CUDA graphs: each step's logits and chosen layers' outputs (the last layer's after
    the final norm) equal the eager static forward's and transformers' own, in float64."""
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    last = len(model.model.layers) - 1
    settings = dict(kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=4, max_rows=5, min_window=16,
                    hidden_layers=(last, 0))
    eager, graphs = static_executor(model, compile="off", **settings), static_executor(model, compile="graphs", **settings)
    eager.forward.llama.kernels = graphs.forward.llama.kernels
    graphs.warm_up(600)
    prompt = list(range(3, 40))
    steps = [[Step(1, 0, prompt, 2)], [Step(1, len(prompt), [5, 6, 7], 3)], [Step(1, len(prompt) + 3, [8], 1)]]
    for batch in steps:
        (a,), (b,) = eager.extend_many(batch, with_hidden=True), graphs.extend_many(batch, with_hidden=True)
        assert torch.allclose(a.logits, b.logits, atol=1e-9) and torch.allclose(a.hidden, b.hidden, atol=1e-9)
    with torch.no_grad():
        reference = model(torch.tensor([prompt + [5, 6, 7, 8]], device="cuda"), output_hidden_states=True)
    assert torch.allclose(b.hidden[:, 0], reference.hidden_states[last + 1][0, -1:], atol=1e-9)
    assert torch.allclose(b.hidden[:, 1], reference.hidden_states[1][0, -1:], atol=1e-9)


@pytest.mark.parametrize("dtype,attention,atol", ATTENTIONS)
def test_trees_replayed_as_cuda_graphs_equal_each_branch_and_keep_the_accepted_path(tiny_pair, dtype, attention, atol):
    """Token trees in the captured decode buckets: trees of different shapes beside a chain in
    one forward give the eager static forward's logits, every node those of its branch run alone
    (transformers' own forward, up to the fused kernels' rounding: measured ~1e-6 in float64); after a
    branch that is not the first is accepted (`Step.path`), the next step's logits are the chain's."""
    model = load_causal_lm(tiny_pair.target_path, "cuda", dtype)
    settings = dict(kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=4, max_rows=8, min_window=16)
    eager = static_executor(model, compile="off", attention="sdpa", **settings)
    graphs = static_executor(model, compile="graphs", **settings)
    assert graphs.forward.llama.attention == attention
    branch_atol = 1e-5 if dtype == "float64" else 1e-3
    eager.forward.llama.kernels = graphs.forward.llama.kernels
    graphs.warm_up(600)
    prompts = {1: PROMPT, 2: list(range(40, 75)), 3: [9, 8, 7]}
    trees = {1: ([7, 9, 11, 13, 15, 19, 21], (-1, 0, -1, 2, 2, 1, 4)), 2: ([3, 4, 5], (-1, -1, 1)), 3: ([6, 7], None)}
    for lm in (eager, graphs):
        lm.extend_many([Step(seq, 0, prompt, 1, reserve=64) for seq, prompt in prompts.items()])
    steps = [Step(seq, len(prompts[seq]), ids, len(ids), tree=tree) for seq, (ids, tree) in trees.items()]
    out = [eager.extend_many(steps), graphs.extend_many(steps)]
    for (seq, (ids, tree)), a, b in zip(trees.items(), *out):
        assert torch.allclose(a, b, atol=atol), (seq, (a - b).abs().max())
        for node in range(len(ids)):
            path, at = [], node
            while at >= 0:
                path.append(ids[at])
                at = tree[at] if tree else at - 1
            with torch.no_grad():
                expected = model(torch.tensor([prompts[seq] + path[::-1]], device="cuda")).logits[0, -1]
            assert torch.allclose(b[node], expected, atol=branch_atol), (seq, node, (b[node] - expected).abs().max())
    keep = len(PROMPT) + 3  # nodes 2 -> 4 -> 6 accepted: 11, 15, 21
    (a,), (b,) = (lm.extend_many([Step(1, keep, [30, 31], 2, path=(2, 4, 6))]) for lm in (eager, graphs))
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT + [11, 15, 21, 30, 31]], device="cuda")).logits[0, -2:]
    assert torch.allclose(a, b, atol=atol) and torch.allclose(b, expected, atol=branch_atol)


def test_rejection_sampling_runs_where_the_logits_are():
    """The orchestrator's accept/reject on device-resident logits (DLPack hand-over) with its CPU generator:
    the same uniforms give the same acceptances as on the CPU, and every correction has residual mass."""
    from specdec.decoding.rejection_sampler import rejection_sample
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        target = torch.softmax(3 * torch.randn(5, 64, generator=gen), -1)
        draft = torch.softmax(3 * torch.randn(4, 64, generator=gen), -1)
        tokens = torch.multinomial(draft, 1, generator=gen).reshape(-1)
        uniforms = torch.rand(4, generator=gen)
        on_cpu = rejection_sample(tokens, draft, target, uniforms, torch.Generator().manual_seed(trial))
        on_gpu = rejection_sample(tokens.cuda(), draft.cuda(), target.cuda(), uniforms.cuda(),
                                  torch.Generator().manual_seed(trial))
        assert on_gpu.num_accepted == on_cpu.num_accepted
        n = on_gpu.num_accepted
        mass = target[n] if n == 4 else (target[n] - draft[n]).clamp_min(0)
        assert mass[on_gpu.next_token] > 0


def test_prefix_caching_under_cuda_graphs_shares_blocks_with_the_same_logits(tiny_pair):
    """On the GPU's default path (static executor, CUDA graphs): sequences sharing a prompt hold the same
    pool blocks and compute what a pool without prefix caching computes, float64, through decode steps in
    captured buckets and a rollback into the shared blocks (a copy of its own)."""
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    settings = dict(kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=4, max_rows=5, min_window=16,
                    compile="graphs")
    shared, plain = static_executor(model, **settings), static_executor(model, prefix_caching=False, **settings)
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(0, 1000, (70,), generator=gen).tolist()
    lengths = {}
    for seq in (1, 2, 3):
        ids = system + torch.randint(0, 1000, (seq,), generator=gen).tolist()
        assert torch.allclose(shared.extend(seq, 0, ids, 1, reserve=120), plain.extend(seq, 0, ids, 1, reserve=120),
                              atol=1e-9)
        lengths[seq] = len(ids)
    assert shared.prefix_hit_tokens == 2 * 64 and shared.sequences[2].blocks[:8] == shared.sequences[1].blocks[:8]
    for _ in range(4):
        steps = [Step(seq, lengths[seq] - seq % 2, torch.randint(0, 1000, (3,), generator=gen).tolist(), 3)
                 for seq in (1, 2, 3)]
        for seq in (1, 2, 3):
            lengths[seq] += 3 - seq % 2
        for a, b in zip(plain.extend_many(steps), shared.extend_many(steps)):
            assert torch.allclose(a, b, atol=1e-9)
    steps = [Step(1, 20, [4, 5], 2), Step(2, lengths[2], [6], 1)]  # 1 rolls back into the shared blocks
    for a, b in zip(plain.extend_many(steps), shared.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-9)
    assert shared.sequences[1].blocks[2] != shared.sequences[2].blocks[2]


def _random_eagle3(target_config, tmp_path=None, **kwargs):
    from specdec.engine.draft_heads import EAGLE3, random_head, save_head
    head = random_head(EAGLE3, target_config, seed=1, aux_layers=(0, 1, 1), draft_vocab_size=4096, **kwargs)
    return head if tmp_path is None else save_head(head, tmp_path / "eagle3-head")


def test_a_head_drafts_from_features_captured_in_cuda_graphs_losslessly(tiny_pair):
    """An EAGLE-3 head on the GPU over the static executor's features (CUDA graphs): greedy equal to
    target-only, sampling seeded and reproducible."""
    from specdec.engine.draft_heads import read_target_tensors
    from specdec.engine.head_executor import HeadExecutor
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    target = static_executor(model, kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=2, max_rows=5,
                             min_window=16, compile="graphs", hidden_layers=(0, 1, 1))
    target.warm_up(600)
    head = _random_eagle3(model.config).to(device="cuda", dtype=torch.float64)
    _, embed, _ = read_target_tensors(tiny_pair.target_path, "cuda", torch.float64)
    head.attach(embed, None)

    draft = HeadExecutor(head)
    alone = run(target, draft, SamplingParams(), 0)
    assert run(target, draft, SamplingParams(), 3) == alone
    params = SamplingParams(temperature=0.8, seed=3)
    assert run(target, draft, params, 3) == run(target, draft, params, 3)


def test_served_on_the_gpu_with_a_head(tmp_path, tiny_pair):
    """A head served on the GPU: target_model's features handed to it on the device (DLPack)."""
    from transformers import AutoConfig
    head_dir = _random_eagle3(AutoConfig.from_pretrained(tiny_pair.target_path), tmp_path)
    args = ["--target", tiny_pair.target_path, "--device", "gpu", "--dtype", "float32", "--draft-head", str(head_dir)]
    own = server.start(tmp_path / "run", tmp_path / "server.log", args, ready_timeout_s=600)
    try:
        client = Client(own.grpc_url)
        greedy = [client.generate("Once upon a time", GenerationParams(max_tokens=24, num_draft_tokens=k,
                                                                       adaptive_draft=False)) for k in (0, 4)]
        assert greedy[0].text == greedy[1].text and greedy[1].total_draft_tokens > 0
        sampled = GenerationParams(max_tokens=24, num_draft_tokens=4, temperature=0.8, seed=11, adaptive_draft=False)
        first, again = client.generate("Hello there", sampled), client.generate("Hello there", sampled)
        assert first.text == again.text and first.total_draft_tokens > 0
    finally:
        own.stop()


def test_a_hosted_head_in_cuda_graphs_drafts_what_the_called_head_drafts(tiny_pair):
    """An EAGLE-3 head hosted in the target's process (hosted_heads.py) over the static executor's captured
    features, its own steps captured: the output and the proposals the same head called gives (float64,
    greedy and sampled, chains and trees)."""
    from specdec.decoding.interfaces import HostedProposer
    from specdec.engine.draft_heads import shared_target_tensors
    from specdec.engine.head_executor import HeadExecutor
    from specdec.engine.hosted_heads import HostedHeads
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")

    def target():
        built = static_executor(model, kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=2, max_rows=9,
                                min_window=16, compile="graphs", hidden_layers=(0, 1, 1))
        built.warm_up(600)
        return built
    head = _random_eagle3(model.config).to(device="cuda", dtype=torch.float64)
    _, embed, _ = shared_target_tensors(model, torch.float64, "cuda")  # borrowed, as target_model's hosted heads
    head.attach(embed, None)
    sampled = SamplingParams(temperature=0.8, seed=3)
    for params, branches in ((SamplingParams(), 1), (SamplingParams(), 3), (sampled, 1)):
        outputs = []
        for hosted in (False, True):
            draft = HeadExecutor(head)
            draft.warm_up()
            proposer = HostedProposer("head", branches) if hosted else LocalProposer(draft, branches)
            scorer = LocalScorer(target(), HostedHeads({"head": draft}, {"head": None}) if hosted else None)
            req = GenerationRequest(seq_id=1, prompt_ids=[5, 17, 3, 88, 41, 9, 60], max_tokens=24, sampling=params)
            policy = DraftLengthPolicy.fixed(4, branches=branches)
            outputs.append(asyncio.run(collect(generate(req, proposer, scorer, policy))))
        assert outputs[0] == outputs[1], (params, branches)


def test_a_hosted_heads_greedy_rounds_run_ahead_in_cuda_graphs(tiny_pair):
    """run_ahead with a hosted EAGLE-3 head over the static executor's captured verifies and the head's captured
    steps: each greedy round's next round drafted and verified before its call (asynchronously, on the device)
    gives every round the proposal and the text the same rounds give without it (float64); K changes between
    rounds take it cut or drop it."""
    from specdec.engine.draft_heads import shared_target_tensors
    from specdec.engine.head_executor import HeadExecutor
    from tests.unit.test_run_ahead import hosted_rounds
    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    head = _random_eagle3(model.config).to(device="cuda", dtype=torch.float64)
    head.attach(shared_target_tensors(model, torch.float64, "cuda")[1], None)

    def executors():
        target = static_executor(model, kv_pool_tokens=4096, block_size=8, max_context=512, max_batch=2, max_rows=9,
                                 min_window=16, compile="graphs", hidden_layers=(0, 1, 1))
        target.warm_up(600)
        drafter = HeadExecutor(head)
        drafter.warm_up()
        return target, drafter
    ks = [4, 4, 4, 3, 4, 2, 4, 0, 4, 4, 4, 4]
    text, proposals, target = hosted_rounds(model, ks, run_ahead=True, executors=executors())
    assert (text, proposals) == hosted_rounds(model, ks, run_ahead=False, executors=executors())[:2]
    assert target.lm.ahead_used >= 4  # taken after rounds 2, 3, 10, 11 (K rising drops it and pauses the next)


@pytest.mark.parametrize("layers", [{}, {"num_layers": 3, "layer_type": "qwen3"}, "mtp"],
                         ids=["one", "three-qwen3", "mtp"])
def test_a_heads_captured_draft_steps_equal_its_eager_ones(tiny_pair, layers):
    """The draft steps replayed as CUDA graphs (head_graphs.py: chain steps, fills, tree levels) propose what
    the eager steps do: the same greedy tokens and trees, the same sampled distributions (float64), over
    several rounds with rollback and across window buckets; an EAGLE-3 head of one layer, and of three Qwen3
    layers (each layer's keys in its own plane of the pool), and an MTP layer (MiMo's: the target's lm_head)."""
    from specdec.engine.interfaces import Step
    from specdec.engine.draft_heads import MTP, random_head, read_target_tensors
    from specdec.engine.head_executor import HeadExecutor
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_pair.target_path)
    head = random_head(MTP, config, seed=1) if layers == "mtp" else _random_eagle3(config, **layers)
    head = head.to(device="cuda", dtype=torch.float64)
    _, embed, lm_head = read_target_tensors(tiny_pair.target_path, "cuda", torch.float64)
    head.attach(embed, lm_head if layers == "mtp" else None)
    eager, graphs = HeadExecutor(head, graphs=False), HeadExecutor(head, graphs=True, max_context=512)
    assert graphs.warm_up()[0] == 3 * len(graphs.steps.rows)  # windows 128, 256, 512 for each row bucket
    width = head.config.feature_width
    torch.manual_seed(0)
    prompt = list(range(5, 125))
    features = torch.randn(len(prompt) - 1, width, dtype=torch.float64)
    sampled = SamplingParams(temperature=0.9)
    for executor in (eager, graphs):
        executor.propose(1, 0, prompt, 0, SamplingParams(), features=features)
    keep = len(prompt) - 1
    for round_ in range(12):  # past position 128: the second window bucket
        new = torch.randn(3, width, dtype=torch.float64)
        a = eager.propose(1, keep, [7, 8, 9, 10], 4, SamplingParams(), features=new)
        b = graphs.propose(1, keep, [7, 8, 9, 10], 4, SamplingParams(), features=new)
        assert a.tokens == b.tokens and a.cached_length == b.cached_length == keep + 3
        keep = a.cached_length
        a = eager.propose(2 + round_, 0, prompt, 4, sampled, make_generator(round_, "cuda:0"), features=features)
        b = graphs.propose(2 + round_, 0, prompt, 4, sampled, make_generator(round_, "cuda:0"), features=features)
        assert a.tokens == b.tokens and torch.allclose(a.probs, b.probs, atol=1e-9)
        tree = [executor.propose_many([Step(1, keep, [11, 12], k=8, params=SamplingParams(), branches=3,
                                            features=new[:1])])[0] for executor in (eager, graphs)]
        assert (tree[0].tokens, tree[0].parents) == (tree[1].tokens, tree[1].parents) and tree[0].parents
        keep = tree[0].cached_length
    assert graphs.sequences[1].slot is not None


def test_a_searched_skip_drafts_cuda_graphs_follow_the_set_chosen():
    """A searched layer-skip draft on the GPU (skip_search: StaticForward.graph_skip): sequences on the set the
    graphs hold replay them, a new set moves the graphs (captured again on first use), sequences on the older
    set run eagerly; logits the model's without those layers (float64, the graphs' compiled pointwise kernels
    against transformers' own on the CPU: 1e-6; a wrong set moves them by tenths)."""
    from tests.unit.test_skip_layers import LAYERS, deep_llama, reference_logits, without

    model = deep_llama()
    first, second = without(model, (1, 3)), without(model, (2, 5, 6))
    lm = static_executor(model.to("cuda"), kv_pool_tokens=1024, block_size=8, max_context=128, max_batch=4,
                         max_rows=5, min_window=16, compile="graphs", skip_layers=(1, 3), skip_search=True)
    ready, _ = lm.warm_up(600)
    inner = lm.forward.inner
    assert lm.forward.graph_skip == (1, 3) and ready == len(inner.captured) > 0
    a, b = list(range(5, 17)), list(range(30, 40))
    lm.extend(1, 0, a, 1)
    got = lm.extend(1, len(a), [7, 8], 2).cpu()
    assert torch.allclose(got, reference_logits(first, a + [7, 8])[-2:], atol=1e-6)
    lm.forward.set_skip((2, 5, 6))
    lm.forward.hold_graphs((2, 5, 6))
    assert not inner.captured
    lm.extend(2, 0, b, 1)
    out = lm.extend_many([Step(1, len(a) + 1, [8, 9], 2), Step(2, len(b), [10, 11], 2)])
    assert torch.allclose(out[0].cpu(), reference_logits(first, a + [7, 8, 9])[-2:], atol=1e-6)
    assert torch.allclose(out[1].cpu(), reference_logits(second, b + [10, 11])[-2:], atol=1e-6)
    out = lm.extend_many([Step(2, len(b) + 2, [12], 1)])
    assert torch.allclose(out[0].cpu(), reference_logits(second, b + [10, 11, 12])[-1:], atol=1e-6)
    assert inner.captured and inner.llama.run_layers == tuple(range(LAYERS))


def test_the_fp8_kernel_computes_the_dequantized_product_for_every_row_count():
    """weights_dtype fp8 on a GPU: the weight-only kernel (up to 128 rows; split along K up to 16) gives the
    dequantized product up to summation order, compiled, the same bits call after call and replayed in a CUDA
    graph; more rows take the dequantized product itself."""
    from specdec.engine import fp8_linear

    device = torch.device("cuda")
    assert fp8_linear.kernel_checks_out(device, torch.bfloat16) is None
    torch.manual_seed(0)
    dense = torch.nn.Linear(4096, 1000, bias=True).to(device, torch.bfloat16)
    fast, slow = fp8_linear.Fp8Linear(dense, kernel=True), fp8_linear.Fp8Linear(dense, kernel=False)
    fp8_linear.reserve(torch.nn.Sequential(fast))
    for rows in (1, 5, 16, 17, 40, 128, 129):
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        a, b = fast(x).float(), slow(x).float()
        assert a.shape == (rows, 1000)
        assert ((a - b).abs().max() / b.abs().max()).item() < 0.01, rows
        assert torch.equal(fast(x).float(), a), rows
    x = torch.randn(5, 4096, device=device, dtype=torch.bfloat16)
    eager = fast(x)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fast(x)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        replayed = fast(x)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)


def test_lora_adapters_in_cuda_graphs_give_the_eager_logits(tiny_pair, tmp_path):
    """LoRA adapters under CUDA graphs (every adapter's product for every row, masked to the row's own): a
    batch of sequences on two adapters and the base model gives the eager executor's logits (float64)."""
    from specdec.engine import lora

    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    paths = {}
    for i in range(2):
        lora.save_adapter(tmp_path / f"a{i}", lora.random_adapter(model, rank=4, seed=i), rank=4, alpha=8)
        paths[f"a{i}"] = str(tmp_path / f"a{i}")
    settings = dict(kv_pool_tokens=4096, block_size=16, max_context=256, max_batch=4, max_rows=5, lora_adapters=paths)
    graphs, eager = static_executor(model, **settings), static_executor(model, compile="off", **settings)
    assert graphs.forward.mode == "graphs"
    # The same fused pointwise kernels both ways (compiled ones round unlike eager ones in float64's last
    # digits): what differs is the capture and the adapters' masked products
    eager.forward.llama.kernels = graphs.forward.llama.kernels
    prompts = [[1 + i, 400, 2000 + i, 37, 912, 5, 77] for i in range(4)]
    for lm in (graphs, eager):
        lm.extend_many([Step(i + 1, 0, prompts[i], 1, adapter=["", "a0", "a1"][i % 3]) for i in range(4)])
    for width in (1, 5):
        steps = [Step(i + 1, 7, [3, 4, 5, 6, 7][:width], width) for i in range(4)]
        for got, want in zip(graphs.extend_many(steps), eager.extend_many(steps)):
            assert torch.allclose(got, want, atol=1e-9), (width, (got - want).abs().max())


def test_adapters_read_on_demand_into_captured_slots_give_the_eager_logits(tiny_pair, tmp_path):
    """Adapters of a directory taking turns in one slot under CUDA graphs (read in place into the tensors the
    graphs captured): each read's logits are the eager executor's (float64)."""
    from specdec.engine import lora

    model = load_causal_lm(tiny_pair.target_path, "cuda", "float64")
    for i in range(3):
        lora.save_adapter(tmp_path / f"a{i}", lora.random_adapter(model, rank=4, seed=i), rank=4, alpha=8)
    settings = dict(kv_pool_tokens=4096, block_size=16, max_context=256, max_batch=4, max_rows=5,
                    lora_directory=str(tmp_path), max_loras=1, max_lora_rank=4)
    graphs, eager = static_executor(model, **settings), static_executor(model, compile="off", **settings)
    assert graphs.forward.mode == "graphs"
    eager.forward.llama.kernels = graphs.forward.llama.kernels  # as above
    prompt = [1, 400, 2000, 37, 912, 5, 77]
    for seq, name in enumerate(("a0", "a1", "a2", "a0"), 1):
        for lm in (graphs, eager):
            lm.extend_many([Step(seq, 0, prompt, 1, adapter=name)])
        for width in (1, 5):
            step = [Step(seq, 7, [3, 4, 5, 6, 7][:width], width)]
            got, want = graphs.extend_many(step)[0], eager.extend_many(step)[0]
            assert torch.allclose(got, want, atol=1e-9), (name, width, (got - want).abs().max())
        for lm in (graphs, eager):
            lm.release(seq)
    assert graphs.adapters.loads == 4
