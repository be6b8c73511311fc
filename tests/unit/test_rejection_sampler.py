"""The accept/reject rule: greedy cases exactly, the stochastic rule statistically (vLLM's method)."""

import pytest
import torch

from specdec.decoding.rejection_sampler import greedy_verify, rejection_sample
from specdec.decoding.sampling import SamplingParams, logits_to_probs


def t(values):
    return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize(
    "draft, target, accepted, nxt",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, 8),  # all accepted: bonus token from position K+1
        ([1, 6, 7], [5, 6, 7, 8], 0, 5),  # first rejected: the target's token replaces it
        ([5, 9, 7], [5, 6, 7, 8], 1, 6),  # middle rejected: later matches do not count
        ([5, 6, 9], [5, 6, 7, 8], 2, 7),  # last rejected
        ([4], [4, 2], 1, 2),  # K = 1 accepted
        ([3], [4, 2], 0, 4),  # K = 1 rejected
        ([], [9], 0, 9),  # K = 0: target-only step
    ],
)
def test_greedy_verify(draft, target, accepted, nxt):
    verdict = greedy_verify(t(draft), t(target))
    assert (verdict.num_accepted, verdict.next_token) == (accepted, nxt)


def test_greedy_verify_requires_k_plus_one_positions():
    with pytest.raises(AssertionError):
        greedy_verify(t([1, 2]), t([1, 2]))


def _random_dists(k, vocab, generator):
    return torch.rand(k, vocab, generator=generator).softmax(-1)


def _empirical_first_token(target_probs, draft_probs, n, generator):
    """Histogram of the first emitted token over n independent rounds with K = draft_probs rows."""
    k, vocab = draft_probs.shape
    counts = torch.zeros(vocab)
    for _ in range(n):
        draft_tokens = torch.stack([torch.multinomial(draft_probs[i], 1, generator=generator)[0] for i in range(k)])
        verdict = rejection_sample(draft_tokens, draft_probs, target_probs, torch.rand(k, generator=generator), generator)
        first = int(draft_tokens[0]) if verdict.num_accepted > 0 else verdict.next_token
        counts[first] += 1
    return counts / n


def test_rejection_sampling_approximates_target_distribution():
    """The distance to the target shrinks with more samples far faster than to unrelated references."""
    g = torch.Generator().manual_seed(0)
    vocab, k = 10, 2
    target = _random_dists(k + 1, vocab, g)
    draft = _random_dists(k, vocab, g)
    references = [_random_dists(1, vocab, g)[0] for _ in range(5)]
    dist_target, dist_refs = [], []
    for n in (100, 30_000):
        empirical = _empirical_first_token(target, draft, n, g)
        dist_target.append(float((empirical - target[0]).abs().sum()))
        dist_refs.append(min(float((empirical - ref).abs().sum()) for ref in references))
    target_shrink = dist_target[0] / dist_target[1]
    reference_shrink = dist_refs[0] / dist_refs[1]
    assert dist_target[1] < 0.03
    assert target_shrink > 5 * reference_shrink


def test_accepted_tokens_follow_target_at_every_position():
    """Given the first token was accepted, the second emitted token is distributed as target[1]."""
    g = torch.Generator().manual_seed(1)
    vocab = 6
    target = _random_dists(2, vocab, g)
    # target[1] is the distribution after x_1; make it independent of x_1 for a marginal check.
    draft = _random_dists(1, vocab, g)
    counts = torch.zeros(vocab)
    n = 20_000
    for _ in range(n):
        x = torch.multinomial(draft[0], 1, generator=g)
        verdict = rejection_sample(x, draft, target, torch.rand(1, generator=g), g)
        if verdict.num_accepted == 1:
            counts[verdict.next_token] += 1
    assert float((counts / counts.sum() - target[1]).abs().sum()) < 0.05


def test_draft_equal_to_target_accepts_everything_without_nan():
    g = torch.Generator().manual_seed(2)
    probs = _random_dists(5, 8, g)
    for _ in range(200):
        draft_tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i in range(4)])
        verdict = rejection_sample(draft_tokens, probs[:4], probs, torch.rand(4, generator=g), g)
        assert verdict.num_accepted == 4
        assert 0 <= verdict.next_token < 8


def test_draft_with_zero_mass_where_target_has_mass():
    """The residual max(0, p_t - p_d) puts the missing mass back: the output still follows the target."""
    g = torch.Generator().manual_seed(3)
    target = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # never proposes tokens 1 and 2
    counts = torch.zeros(4)
    n = 20_000
    for _ in range(n):
        verdict = rejection_sample(t([0]), draft, target, torch.rand(1, generator=g), g)
        counts[0 if verdict.num_accepted else verdict.next_token] += 1
    assert float((counts / n - target[0]).abs().sum()) < 0.03
    assert counts[3] == 0  # never emits a token the target gives no mass


def test_draft_token_the_target_excludes_is_always_rejected():
    target = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    draft = torch.tensor([[0.5, 0.5, 0.0]])
    verdict = rejection_sample(t([0]), draft, target, torch.tensor([0.0]), torch.Generator().manual_seed(0))
    assert (verdict.num_accepted, verdict.next_token) == (0, 1)


def test_top_k_1_sampling_equals_greedy():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=g)
    params = SamplingParams(temperature=0.8, top_k=1)
    probs = logits_to_probs(logits, params)
    draft_tokens = logits[:3].argmax(-1)
    verdict = rejection_sample(draft_tokens, probs[:3], probs, torch.rand(3, generator=g), g)
    assert verdict == greedy_verify(draft_tokens, logits.argmax(-1))
