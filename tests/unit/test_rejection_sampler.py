"""The accept/reject rule: greedy cases exactly, the stochastic rule statistically (vLLM's method)."""

import pytest
import torch

from specdec.decoding.rejection_sampler import Verdict, greedy_verify, rejection_sample
from specdec.decoding.sampling import SamplingParams, logits_to_probs

from .stats import chi_square_rejects, exact_joint


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
    assert greedy_verify(draft, target) == verdict  # lists, as the loop passes them


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


# ---- the joint distribution of whole rounds, against planted bugs ------------------------------------
# A context-dependent pair: every prefix of up to K+1 tokens over a vocabulary of V has its own peaked
# target and draft distributions (softmax of 3·randn) with top-k / top-p zeros, so a rejection at
# position 2+ sees different rows than one at position 1, and the draft puts mass where the target has
# none. Rounds of K = 3 run until K + 1 = 4 tokens are out; the empirical joint distribution of those 4
# tokens is compared with the exact target joint by a chi-square test at significance 1e-3.
V, K, ROUNDS = 5, 3, 12_000


def _tables() -> tuple[dict, dict]:
    """Target and draft rows per prefix; the draft's logits are the target's plus noise (a draft that
    mostly agrees, so whole rounds are often accepted and the bonus token matters)."""
    g = torch.Generator().manual_seed(10)
    prefixes = [()]
    for _ in range(K + 1):
        prefixes += [p + (v,) for p in prefixes if len(p) == len(prefixes[-1]) for v in range(V)]
    target, draft = {}, {}
    for prefix in prefixes:
        logits = 3 * torch.randn(V, generator=g)
        target[prefix] = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
        draft[prefix] = logits_to_probs(logits + 1.5 * torch.randn(V, generator=g),
                                        SamplingParams(temperature=1.0, top_p=0.9))
    return target, draft


TARGET, DRAFT = _tables()


def _sample_joint(sampler, seed: int) -> torch.Tensor:
    """Counts over the V^(K+1) joint outcomes of the first K+1 tokens."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V ** (K + 1))
    for _ in range(ROUNDS):
        out: tuple[int, ...] = ()
        while len(out) < K + 1:
            drafted, draft_rows = [], []
            for _ in range(K):
                row = DRAFT[(out + tuple(drafted))[:K + 1]]
                draft_rows.append(row)
                drafted.append(int(torch.multinomial(row, 1, generator=g)))
            target_rows = torch.stack([TARGET[(out + tuple(drafted[:i]))[:K + 1]] for i in range(K + 1)])
            verdict = sampler(torch.tensor(drafted), torch.stack(draft_rows), target_rows,
                              torch.rand(K, generator=g), g)
            out += tuple(drafted[:verdict.num_accepted]) + (verdict.next_token,)
        index = 0
        for token in out[:K + 1]:
            index = index * V + token
        counts[index] += 1
    return counts


def _with_planted_residual(residual):
    """rejection_sample with its residual replaced: residual(i, draft_probs, target_probs) gives the weights
    a rejection at position i resamples from."""
    def sampler(draft_tokens, draft_probs, target_probs, uniforms, generator=None):
        k = draft_tokens.shape[0]
        positions = torch.arange(k)
        rejected = (uniforms * draft_probs[positions, draft_tokens] >= target_probs[positions, draft_tokens]).nonzero()
        if not rejected.numel():
            return Verdict(k, int(torch.multinomial(target_probs[k], 1, generator=generator)))
        first = int(rejected[0, 0])
        weights = residual(first, draft_probs, target_probs)
        return Verdict(first, int(torch.multinomial(weights / weights.sum(), 1, generator=generator)))

    return sampler


# Planted bug: at a rejection, resample from the target where p_t > p_d (a mask), not max(0, p_t - p_d).
_residual_as_mask = _with_planted_residual(lambda i, draft, target: target[i] * (target[i] > draft[i]))
# Planted bug: a rejection at position 2+ takes its residual from the rows of position 1.
_first_row_at_every_rejection = _with_planted_residual(
    lambda i, draft, target: (target[0] - draft[0]).clamp_min(0) + 1e-12 * target[0])


def _bonus_from_draft(draft_tokens, draft_probs, target_probs, uniforms, generator=None):
    """Planted bug: when all K are accepted, the bonus token comes from the draft's last row."""
    verdict = rejection_sample(draft_tokens, draft_probs, target_probs, uniforms, generator)
    k = draft_tokens.shape[0]
    if verdict.num_accepted == k:
        return Verdict(k, int(torch.multinomial(draft_probs[k - 1], 1, generator=generator)))
    return verdict


def test_rounds_give_exactly_the_targets_joint_distribution():
    assert not chi_square_rejects(_sample_joint(rejection_sample, seed=0), exact_joint(TARGET, V, K + 1))


@pytest.mark.parametrize("planted", [_residual_as_mask, _bonus_from_draft, _first_row_at_every_rejection])
def test_the_joint_test_catches_planted_bugs(planted):
    """The same test on a sampler with a known bug must fail: proof that it can."""
    assert chi_square_rejects(_sample_joint(planted, seed=0), exact_joint(TARGET, V, K + 1))
