"""Per-sequence KV caches: incremental steps and rollbacks give exactly the logits of a fresh forward."""

import pytest
import torch
from transformers import DynamicCache

from specdec.causal_lm import CacheError, CausalLM
from specdec.sampling import SamplingParams, make_generator


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_dynamic_cache_crop_takes_negative_count(tiny_lm):
    """Pins the installed transformers' crop semantics that rollback relies on."""
    cache = DynamicCache(config=tiny_lm.config)
    with torch.no_grad():
        tiny_lm(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, use_cache=True)
    cache.crop(-2)
    assert cache.get_seq_length() == 3


def test_incremental_extend_matches_full_forward(tiny_lm):
    lm = CausalLM(tiny_lm)
    ids = [5, 17, 3, 88, 41, 2, 9]
    first = lm.extend(1, 0, ids[:4], 2)
    second = lm.extend(1, 4, ids[4:], 3)
    reference = full_logits(tiny_lm, ids)
    assert torch.allclose(first, reference[2:4], atol=1e-10)
    assert torch.allclose(second, reference[4:7], atol=1e-10)
    assert lm.cached_length(1) == 7 and lm.tokens_processed == 7


def test_rollback_after_rejection_is_consistent(tiny_lm):
    """Append rejected tokens, roll back to the accepted prefix, continue: same as never drafting them."""
    lm = CausalLM(tiny_lm)
    prompt = [5, 17, 3, 88]
    lm.extend(7, 0, prompt, 1)
    lm.extend(7, 4, [10, 11, 12, 13], 4)  # a (K+1)-token verify; only 10 is accepted
    after = lm.extend(7, 5, [60, 61], 2)  # keep prompt + 10, then the correction and one more token
    reference = full_logits(tiny_lm, prompt + [10, 60, 61])
    assert torch.allclose(after, reference[-2:], atol=1e-10)
    assert lm.cached_length(7) == 7


def test_rollback_to_zero_restarts_the_sequence(tiny_lm):
    lm = CausalLM(tiny_lm)
    lm.extend(3, 0, [1, 2, 3], 1)
    again = lm.extend(3, 0, [4, 5], 1)
    assert torch.allclose(again, full_logits(tiny_lm, [4, 5])[-1:], atol=1e-10)


def test_sequences_are_independent(tiny_lm):
    lm = CausalLM(tiny_lm)
    lm.extend(1, 0, [1, 2, 3], 1)
    b = lm.extend(2, 0, [7, 8], 1)
    a = lm.extend(1, 3, [4], 1)
    assert torch.allclose(a, full_logits(tiny_lm, [1, 2, 3, 4])[-1:], atol=1e-10)
    assert torch.allclose(b, full_logits(tiny_lm, [7, 8])[-1:], atol=1e-10)


def test_greedy_propose_matches_greedy_decoding(tiny_lm):
    lm = CausalLM(tiny_lm)
    prompt = [5, 17, 3]
    tokens, probs = lm.propose(1, 0, prompt, 4, SamplingParams())
    ids = list(prompt)
    for _ in range(4):
        ids.append(int(full_logits(tiny_lm, ids)[-1].argmax()))
    assert tokens == ids[3:] and probs is None
    assert lm.cached_length(1) == 3 + 4 - 1  # the last proposal is not run through the model


def test_sampled_propose_is_reproducible_and_returns_distributions(tiny_lm):
    params = SamplingParams(temperature=1.0, top_k=20)
    runs = []
    for _ in range(2):
        lm = CausalLM(tiny_lm)
        runs.append(lm.propose(1, 0, [5, 6], 3, params, make_generator(11)))
    (tokens_a, probs_a), (tokens_b, probs_b) = runs
    assert tokens_a == tokens_b and torch.equal(probs_a, probs_b)
    assert probs_a.shape == (3, 97)
    assert all(probs_a[i, tok] > 0 for i, tok in enumerate(tokens_a))


def test_cache_errors_name_the_problem(tiny_lm):
    lm = CausalLM(tiny_lm, max_sequences=1)
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
    lm = CausalLM(tiny_lm, idle_timeout_s=10, clock=lambda: now[0])
    lm.extend(1, 0, [1], 1)
    lm.extend(2, 0, [1], 1)
    assert lm.release(1) and not lm.release(1)
    now[0] = 5.0
    lm.extend(3, 0, [1], 1)
    now[0] = 12.0
    assert lm.evict_idle() == [2]
    assert set(lm.sequences) == {3}
