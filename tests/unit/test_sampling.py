import pytest
import torch

from specdec.decoding.sampling import (NUCLEUS_PROBE, SamplingParams, greedy, logits_to_probs, make_generator, sample,
                                      sorted_top_p_floor, top_p_floor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_picks_argmax_tokens_ties_and_nan_included(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 1000).to(dtype)
    logits[1, [7, 500]] = 100.0  # a tie: the first maximum, as argmax
    logits[2, [3, 9]] = float("nan")  # NaN is the maximum, its first position, as argmax
    logits[3] = 0.0
    assert greedy(logits).tolist() == logits.argmax(-1).tolist()
    assert greedy(logits)[1:4].tolist() == [7, 3, 0]
    assert greedy(logits[0]).item() == logits[0].argmax().item()


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_temperature_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, (logits / 2).softmax(-1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[0] == 0 and probs[3] == 0
    assert torch.allclose(probs[1:3].sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 alone < 0.8, 0.5 + 0.3 reaches it: tokens 0 and 1 stay
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_always_keeps_the_most_likely_token():
    probs = logits_to_probs(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_p=1e-6))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0]))


def _top_p_by_position(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook rule, for reference: sort, drop a token once the mass before it reaches top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf")).softmax(-1)


@pytest.mark.parametrize("vocab, dtype", [(300, torch.float64), (49152, torch.float32)])
def test_top_p_on_cpu_finds_the_nucleus_a_full_sort_finds(vocab, dtype):
    """The CPU path (the most likely NUCLEUS_PROBE tokens, a partial sort where the nucleus is wider)
    against sorting whole rows: rows from peaked to nearly flat, nuclei of one token to most of the
    vocabulary, in a (2, 4, V) batch. The same boundary, and the textbook rule's tokens."""
    torch.manual_seed(3)
    scales = torch.tensor([0.05, 0.3, 1.0, 2.0, 4.0, 8.0, 16.0, 40.0], dtype=dtype)
    logits = (torch.randn(8, vocab, dtype=dtype) * scales[:, None]).reshape(2, 4, vocab)
    wide = 0
    for top_p in (1e-6, 0.5, 0.9, 0.999):
        probs = logits.float().softmax(-1)
        floor = top_p_floor(probs, top_p)
        assert floor.shape == (2, 4, 1)
        assert torch.equal(floor.reshape(8, 1), sorted_top_p_floor(probs.reshape(8, vocab), top_p))
        kept = (probs >= floor).sum(-1)
        wide += int((kept > NUCLEUS_PROBE).sum())
        processed = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        torch.testing.assert_close(processed, _top_p_by_position(logits.float(), top_p))
    if vocab > NUCLEUS_PROBE:
        assert wide > 0  # some rows took the partial sort


def test_top_p_keeps_tokens_tied_at_the_boundary_together():
    """Which of several equally likely tokens a sort puts first is arbitrary: all of them stay."""
    probs = logits_to_probs(torch.tensor([0.4, 0.2, 0.2, 0.2]).log(), SamplingParams(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([0.4, 0.2, 0.2, 0.2]))
    wide = torch.full((1000,), 1.0).log()  # a flat row beyond the probe: every token ties
    assert bool((logits_to_probs(wide, SamplingParams(temperature=1.0, top_p=0.5)) > 0).all())


@pytest.mark.parametrize("params", [SamplingParams(0.7, 5, 0.9), SamplingParams(1.3, 0, 1.0)])
def test_probabilities_sum_to_one(params):
    probs = logits_to_probs(torch.randn(3, 100), params)
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_seeded_generator_reproduces():
    probs = torch.full((10,), 0.1)
    a = [int(sample(probs, make_generator(7))) for _ in range(5)]
    b = [int(sample(probs, make_generator(7))) for _ in range(5)]
    assert a == b
    g = make_generator(7)
    draws = {int(sample(probs, g)) for _ in range(50)}
    assert len(draws) > 1


def test_sampling_on_cpu_draws_each_token_with_its_probability():
    """The CPU draw (the inverse of the cumulative distribution, not torch's multinomial): 40000 draws per
    row of a batch, chi-square at significance 1e-4 (critical values for 9 and 3 degrees of freedom);
    tokens of zero probability, first, inside and last, are never drawn; unnormalized rows draw in
    proportion; an invalid row is refused."""
    rows = torch.tensor([[0.0, 0.3, 0.0, 0.1, 0.05, 0.05, 0.2, 0.0, 0.1, 0.1, 0.04, 0.01, 0.05, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.0]])
    n, generator = 40000, make_generator(5)
    for row, critical in zip(rows, (33.72, 21.11)):
        draws = sample(row.expand(n, -1), generator)
        assert draws.shape == (n,) and draws.dtype == torch.int64
        counts = torch.bincount(draws, minlength=row.numel()).double()
        assert (counts[row == 0] == 0).all()
        expected = row.double()[row > 0] / row.sum() * n
        assert float(((counts[row > 0] - expected) ** 2 / expected).sum()) < critical
    for bad in ([float("nan"), 1.0], [0.0, 0.0], [-0.1, 1.1], [float("inf"), 1.0]):
        with pytest.raises(ValueError, match="probabilities"):
            sample(torch.tensor(bad), generator)


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, min_p=0.2))
    # kept: p >= 0.2 * 0.5 = 0.1, i.e. the first three
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    only_max = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, min_p=1.0))
    assert torch.equal(only_max, torch.tensor([1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("params", [SamplingParams(0.8, 0, 1.0, min_p=0.05), SamplingParams(1.3, 40, 0.9, min_p=0.1),
                                    SamplingParams(0.6, 0, 0.95, min_p=0.3), SamplingParams(1.0, 20, 1.0)])
def test_processing_equals_transformers_warpers(params):
    """Temperature, top-k, top-p and min-p as transformers' generate chains its warpers."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    torch.manual_seed(1)
    logits = torch.randn(4, 500) * 3
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    torch.testing.assert_close(logits_to_probs(logits, params), scores.softmax(-1))


def test_devices_named_with_and_without_an_index_are_one():
    from specdec.decoding.sampling import same_device

    assert same_device("cpu", torch.device("cpu")) and same_device(torch.device("cpu", 0), "cpu")
    assert not same_device("cpu", "meta")
    if torch.cuda.is_available():
        assert same_device("cuda", f"cuda:{torch.cuda.current_device()}")
