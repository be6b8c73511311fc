"""Per-sequence KV caches: incremental steps and rollbacks give exactly the logits of a fresh forward."""

import copy

import pytest
import torch

from specdec.decoding.sampling import SamplingParams, make_generator
from specdec.engine.build import dynamic_executor
from specdec.engine.executor import CacheError
from specdec.engine.transformers_forward import EXACT_ROWS, padded_rows


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_incremental_extend_matches_full_forward(tiny_lm):
    lm = dynamic_executor(tiny_lm)
    ids = [5, 17, 3, 88, 41, 2, 9]
    first = lm.extend(1, 0, ids[:4], 2)
    second = lm.extend(1, 4, ids[4:], 3)
    reference = full_logits(tiny_lm, ids)
    assert torch.allclose(first, reference[2:4], atol=1e-10)
    assert torch.allclose(second, reference[4:7], atol=1e-10)
    assert lm.cached_length(1) == 7 and lm.tokens_processed == 7


def test_rollback_after_rejection_is_consistent(tiny_lm):
    """Append rejected tokens, roll back to the accepted prefix, continue: same as never drafting them."""
    lm = dynamic_executor(tiny_lm)
    prompt = [5, 17, 3, 88]
    lm.extend(7, 0, prompt, 1)
    lm.extend(7, 4, [10, 11, 12, 13], 4)  # a (K+1)-token verify; only 10 is accepted
    after = lm.extend(7, 5, [60, 61], 2)  # keep prompt + 10, then the correction and one more token
    reference = full_logits(tiny_lm, prompt + [10, 60, 61])
    assert torch.allclose(after, reference[-2:], atol=1e-10)
    assert lm.cached_length(7) == 7


def test_rollback_to_zero_restarts_the_sequence(tiny_lm):
    lm = dynamic_executor(tiny_lm)
    lm.extend(3, 0, [1, 2, 3], 1)
    again = lm.extend(3, 0, [4, 5], 1)
    assert torch.allclose(again, full_logits(tiny_lm, [4, 5])[-1:], atol=1e-10)


def test_sequences_are_independent(tiny_lm):
    lm = dynamic_executor(tiny_lm)
    lm.extend(1, 0, [1, 2, 3], 1)
    b = lm.extend(2, 0, [7, 8], 1)
    a = lm.extend(1, 3, [4], 1)
    assert torch.allclose(a, full_logits(tiny_lm, [1, 2, 3, 4])[-1:], atol=1e-10)
    assert torch.allclose(b, full_logits(tiny_lm, [7, 8])[-1:], atol=1e-10)


def test_greedy_propose_matches_greedy_decoding(tiny_lm):
    lm = dynamic_executor(tiny_lm)
    prompt = [5, 17, 3]
    tokens, probs, cached_length, _ = lm.propose(1, 0, prompt, 4, SamplingParams())
    ids = list(prompt)
    for _ in range(4):
        ids.append(int(full_logits(tiny_lm, ids)[-1].argmax()))
    assert tokens == ids[3:] and probs is None
    assert lm.cached_length(1) == cached_length == 3 + 4 - 1  # the last proposal is not run through the model


def test_sampled_propose_is_reproducible_and_returns_distributions(tiny_lm):
    params = SamplingParams(temperature=1.0, top_k=20)
    runs = []
    for _ in range(2):
        lm = dynamic_executor(tiny_lm)
        runs.append(lm.propose(1, 0, [5, 6], 3, params, make_generator(11)))
    (tokens_a, probs_a, *_), (tokens_b, probs_b, *_) = runs
    assert tokens_a == tokens_b and torch.equal(probs_a, probs_b)
    assert probs_a.shape == (3, 97)
    assert all(probs_a[i, tok] > 0 for i, tok in enumerate(tokens_a))


def test_cache_errors_name_the_problem(tiny_lm):
    lm = dynamic_executor(tiny_lm, max_sequences=1)
    with pytest.raises(CacheError, match="has no cache"):
        lm.extend(1, 3, [1], 1)
    lm.extend(1, 0, [1, 2], 1)
    with pytest.raises(CacheError, match="exceeds"):
        lm.extend(1, 5, [1], 1)
    with pytest.raises(CacheError, match="too many live sequences"):
        lm.extend(2, 0, [1], 1)
    with pytest.raises(CacheError, match="num_logits"):
        lm.extend(1, 2, [1], 2)


def test_release_and_idle_eviction(tiny_lm):
    now = [0.0]
    lm = dynamic_executor(tiny_lm, idle_timeout_s=10, clock=lambda: now[0])
    lm.extend(1, 0, [1], 1)
    lm.extend(2, 0, [1], 1)
    assert lm.release(1) and not lm.release(1)
    now[0] = 5.0
    lm.extend(3, 0, [1], 1)
    now[0] = 12.0
    assert lm.evict_idle() == [2]
    assert set(lm.sequences) == {3}


# ---- batched steps over several sequences ------------------------------------------------------------
def test_batched_extend_equals_each_sequences_own_forward(tiny_lm):
    """Different cache lengths, different numbers of new tokens, a new sequence and a rollback, in one
    padded forward: every row's logits and resulting cache equal a fresh forward of that sequence."""
    from specdec.engine.executor import Step

    lm = dynamic_executor(tiny_lm)
    lm.extend(1, 0, [5, 17, 3, 88, 41, 2, 9], 1)
    lm.extend(2, 0, [7, 8], 1)
    lm.extend(3, 0, [30, 31, 32, 33, 34], 1)
    out = lm.extend_many([
        Step(1, 7, [10, 11, 12, 13, 14], num_logits=5),  # a K=4 verify on the longest cache
        Step(2, 2, [60], num_logits=1),  # a plain step
        Step(3, 3, [70, 71], num_logits=2),  # roll back 2 tokens, then append
        Step(4, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9], num_logits=1),  # a new sequence's prompt
    ])
    expected = {
        0: (full_logits(tiny_lm, [5, 17, 3, 88, 41, 2, 9, 10, 11, 12, 13, 14])[-5:]),
        1: (full_logits(tiny_lm, [7, 8, 60])[-1:]),
        2: (full_logits(tiny_lm, [30, 31, 32, 70, 71])[-2:]),
        3: (full_logits(tiny_lm, [1, 2, 3, 4, 5, 6, 7, 8, 9])[-1:]),
    }
    for i, reference in expected.items():
        assert out[i].shape == reference.shape
        assert torch.allclose(out[i], reference, atol=1e-9), i
    assert [lm.cached_length(s) for s in (1, 2, 3, 4)] == [12, 3, 5, 9]
    # The caches handed back continue correctly, alone or batched again.
    alone = lm.extend(2, 3, [61], 1)
    assert torch.allclose(alone, full_logits(tiny_lm, [7, 8, 60, 61])[-1:], atol=1e-9)
    again = lm.extend_many([Step(1, 8, [95], 1), Step(3, 5, [72], 1)])
    assert torch.allclose(again[0], full_logits(tiny_lm, [5, 17, 3, 88, 41, 2, 9, 10, 95])[-1:], atol=1e-9)
    assert torch.allclose(again[1], full_logits(tiny_lm, [30, 31, 32, 70, 71, 72])[-1:], atol=1e-9)


def test_batched_step_errors_stay_with_their_step(tiny_lm):
    from specdec.engine.executor import Step

    lm = dynamic_executor(tiny_lm)
    lm.extend(1, 0, [1, 2, 3], 1)
    out = lm.extend_many([Step(1, 3, [4], 1), Step(9, 5, [1], 1), Step(2, 0, [], 1)])
    assert torch.allclose(out[0], full_logits(tiny_lm, [1, 2, 3, 4])[-1:], atol=1e-9)
    assert isinstance(out[1], CacheError) and "no cache" in str(out[1])
    assert isinstance(out[2], CacheError)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_propose_equals_one_by_one(tiny_lm, temperature):
    from specdec.engine.executor import Step

    params = SamplingParams(temperature=temperature)
    solo, batched = dynamic_executor(tiny_lm), dynamic_executor(tiny_lm)
    prompts = {1: [5, 17, 3, 88], 2: [7, 8], 3: [30, 31, 32, 33, 34, 35]}
    ks = {1: 4, 2: 1, 3: 3}
    expected = {}
    for sid, prompt in prompts.items():
        gen = make_generator(sid) if temperature else None
        expected[sid] = solo.propose(sid, 0, prompt, ks[sid], params, gen)
    steps = [Step(sid, 0, prompt, k=ks[sid], params=params, generator=make_generator(sid) if temperature else None)
             for sid, prompt in prompts.items()]
    for (tokens, probs, *_), sid in zip(batched.propose_many(steps), prompts):
        assert tokens == expected[sid][0]
        if temperature:
            assert torch.allclose(probs, expected[sid][1], atol=1e-9)
        assert batched.cached_length(sid) == solo.cached_length(sid) == len(prompts[sid]) + ks[sid] - 1


def test_padding_to_min_forward_rows_changes_nothing_but_the_shape(tiny_lm):
    """min_forward_rows=4 pads a 2-token verify of one sequence and a 3-sequence step to 4 rows; the
    logits and caches are those of the unpadded forwards."""
    from specdec.engine.executor import Step

    lm = dynamic_executor(tiny_lm, min_forward_rows=4)
    lm.extend(1, 0, [5, 17, 3], 1)
    two = lm.extend(1, 3, [88, 41], 2)
    assert torch.allclose(two, full_logits(tiny_lm, [5, 17, 3, 88, 41])[-2:], atol=1e-9)
    assert lm.cached_length(1) == 5
    lm.extend(2, 0, [7, 8], 1)
    lm.extend(3, 0, [30], 1)
    out = lm.extend_many([Step(1, 5, [2], 1), Step(2, 2, [9], 1), Step(3, 1, [31], 1)])
    for logits, ids in zip(out, ([5, 17, 3, 88, 41, 2], [7, 8, 9], [30, 31])):
        assert logits.shape == (1, tiny_lm.config.vocab_size)
        assert torch.allclose(logits, full_logits(tiny_lm, ids)[-1:], atol=1e-9)
    assert [lm.cached_length(s) for s in (1, 2, 3)] == [6, 3, 2]
    after = lm.extend(3, 2, [32], 1)  # the padded step left a clean cache behind
    assert torch.allclose(after, full_logits(tiny_lm, [30, 31, 32])[-1:], atol=1e-9)


def test_padded_rows_bounds_the_shapes_and_the_padding():
    assert [padded_rows(n, 4) for n in (1, 2, 3, 4, 5)] == [1, 4, 4, 4, 5]
    assert [padded_rows(n, 1, bucketed=True) for n in (1, 2, 16, 17, 19, 32, 33, 300)] == [1, 2, 16, 18, 20, 32, 36, 320]
    sizes = [padded_rows(n, 1, bucketed=True) for n in range(1, 4097)]
    assert all(n <= size <= n * 1.125 for n, size in enumerate(sizes, 1))
    assert sizes[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert len(set(sizes)) == EXACT_ROWS + 8 * 8  # 8 sizes per power of two past 16
    assert padded_rows(300) == 300  # not bucketed: every size as it comes


def test_row_buckets_change_nothing_but_the_shape(tiny_lm):
    """row_buckets pads a 33-token prompt to 36 rows, a 17-position verify to 18 and a 3-sequence step of
    19 rows to 20: the forwards run at the bucket sizes, the logits and caches are the unpadded ones."""
    from specdec.engine.executor import Step

    shapes = []
    def record(_module, _args, kwargs):  # the executor's forwards (the reference ones pass no kv_batch)
        if "kv_batch" in kwargs:
            shapes.append((kwargs["input_ids"].shape[1], len(kwargs["logits_to_keep"])))

    hook = tiny_lm.register_forward_pre_hook(record, with_kwargs=True)
    try:
        lm = dynamic_executor(tiny_lm, row_buckets=True)
        ids = [int(x) for x in torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(5))]
        prompt = lm.extend(1, 0, ids[:33], 33)
        assert torch.allclose(prompt, full_logits(tiny_lm, ids[:33]), atol=1e-9)
        verify = lm.extend(1, 33, ids[33:50], 17)
        assert torch.allclose(verify, full_logits(tiny_lm, ids[:50])[33:], atol=1e-9)
        lm.extend(2, 0, ids[:2], 1)
        lm.extend(3, 0, ids[2:4], 1)
        out = lm.extend_many([Step(1, 40, ids[40:47], 7), Step(2, 2, ids[4:10], 1), Step(3, 1, ids[10:16], 2)])
        for logits, seq, n in zip(out, (ids[:47], ids[:2] + ids[4:10], ids[2:3] + ids[10:16]), (7, 1, 2)):
            assert torch.allclose(logits, full_logits(tiny_lm, seq)[-n:], atol=1e-9)
        assert [lm.cached_length(s) for s in (1, 2, 3)] == [47, 8, 7]
        after = lm.extend(1, 47, [9], 1)  # the padded steps left clean caches behind
        assert torch.allclose(after, full_logits(tiny_lm, ids[:47] + [9])[-1:], atol=1e-9)
    finally:
        hook.remove()
    assert shapes == [(36, 36), (18, 18), (2, 1), (2, 1), (20, 10), (1, 1)]


# ---- the per-sequence KV buffers (kv_cache.py) ---------------------------------------------------------
def test_buffers_grow_past_their_initial_capacity_without_losing_content(tiny_lm):
    """Steps that cross the 64-position initial capacity (and a rollback across it) still equal a fresh
    forward: growing copies the valid positions."""
    lm = dynamic_executor(tiny_lm)
    ids = [int(x) for x in torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(3))]
    lm.extend(1, 0, ids[:60], 1)
    assert lm.sequences[1].capacity == 64
    lm.extend(1, 60, ids[60:70], 1)  # crosses 64: doubles to 128
    assert lm.sequences[1].capacity == 128
    lm.extend(1, 70, [1, 2, 3], 3)  # drafted and rejected
    grown = lm.extend(1, 70, ids[70:150], 2)  # roll back, then cross 128
    assert torch.allclose(grown, full_logits(tiny_lm, ids)[-2:], atol=1e-9)
    assert lm.sequences[1].capacity == 256 and lm.cached_length(1) == 150
    assert lm.kv_bytes_allocated == 256 * lm.kv_bytes_per_token
    lm.release(1)
    assert lm.kv_bytes_allocated == 0


def test_sliding_window_attention_matches_transformers():
    """A model with a sliding window (Mistral) computes the window's mask per row like transformers does."""
    from transformers import MistralConfig, MistralForCausalLM

    from specdec.engine.executor import Step

    torch.manual_seed(1)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, initializer_range=0.5)).to(torch.float64).eval()
    reference = dynamic_executor(model)  # registers our attention; plain forwards fall back to transformers' SDPA
    ids = [5, 17, 3, 88, 41, 2, 9, 10, 11, 12]
    full = full_logits(model, ids)
    windowless = MistralForCausalLM(MistralConfig(**{**model.config.to_dict(), "sliding_window": None}))
    windowless.load_state_dict(model.state_dict())
    assert not torch.allclose(full[-1], full_logits(windowless.to(torch.float64).eval(), ids)[-1])  # the window matters
    reference.extend(1, 0, ids[:3], 1)
    out = reference.extend_many([Step(1, 3, ids[3:8], 5), Step(2, 0, ids[:9], 2)])
    assert torch.allclose(out[0], full[3:8], atol=1e-9)
    assert torch.allclose(out[1], full[7:9], atol=1e-9)
    assert torch.allclose(reference.extend(1, 8, ids[8:], 2), full[8:], atol=1e-9)
    one_step = reference.extend(1, 10, [13], 1)  # a single query past the window
    assert torch.allclose(one_step, full_logits(model, ids + [13])[-1:], atol=1e-9)


def _windowed_models():
    """A Mistral (sliding window 4) and a gpt-oss (sliding and full layers, attention sinks, experts), float64,
    each with a reference copy that runs transformers' own attention: SDPA for Mistral (its eager attention
    takes the softmax in float32), eager for gpt-oss (the one with sinks, in the logits' dtype)."""
    from transformers import GptOssConfig, GptOssForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    mistral = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=4, initializer_range=0.5)
    gpt_oss = GptOssConfig(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                           initializer_range=0.5, max_position_embeddings=256,
                           experts_implementation="eager")  # (grouped_mm takes no float64)
    for cls, config, attention in ((MistralForCausalLM, mistral, "sdpa"), (GptOssForCausalLM, gpt_oss, "eager")):
        model = cls(config).to(torch.float64).eval()
        if hasattr(model.model.layers[0].self_attn, "sinks"):  # initialised at 0 by default: make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.data.normal_(0.0, 2.0)
        reference = cls(copy.deepcopy(config)).to(torch.float64).eval()  # (a config of its own: the executor
        reference.load_state_dict(model.state_dict())  # sets the model's attention on its config)
        reference.set_attn_implementation(attention)
        yield config.model_type, model, reference


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_windowed_attention_and_attention_sinks_match_transformers_eager_forward_chains_and_trees(name):
    """The per-sequence KV attention over a sliding window (every layer or some: gpt-oss alternates) and with
    gpt-oss's attention sinks (a logit per head in every softmax, which SDPA has no term for): steps, a packed
    batch, a rollback and a token tree whose deep nodes see only their window equal transformers' eager forward
    of each sequence (float64). Its plain forwards (no cache) too."""
    from specdec.engine.executor import Step

    (model, reference), = [(m, r) for kind, m, r in _windowed_models() if kind == name]
    lm = dynamic_executor(model)
    ids = [5, 17, 3, 88, 41, 2, 9, 10, 11, 12, 40, 41, 42]
    full = full_logits(reference, ids)
    assert torch.allclose(full_logits(model, ids), full, atol=1e-9)  # the plain forward
    lm.extend(1, 0, ids[:3], 1)
    out = lm.extend_many([Step(1, 3, ids[3:8], 5), Step(2, 0, ids[:9], 2)])
    assert torch.allclose(out[0], full[3:8], atol=1e-9) and torch.allclose(out[1], full[7:9], atol=1e-9)
    lm.extend(1, 8, [1, 2, 3, 4, 5], 5)  # drafted, then rejected: rolled back below
    assert torch.allclose(lm.extend(1, 8, ids[8:11], 3), full[8:11], atol=1e-9)
    # a tree after 11 cached tokens: branches a -> b -> c -> d -> e (past the window of 4) and f -> g
    a, b, c, d, e, f, g = 60, 61, 62, 63, 64, 70, 71
    (logits,) = lm.extend_many([Step(1, 11, [a, b, c, d, e, f, g], num_logits=7, tree=(-1, 0, 1, 2, 3, -1, 5))])
    for node, path in enumerate([[a], [a, b], [a, b, c], [a, b, c, d], [a, b, c, d, e], [f], [f, g]]):
        assert torch.allclose(logits[node], full_logits(reference, ids[:11] + path)[-1], atol=1e-9), node
