"""What the exact-distribution tests of the accept/reject rules share: the target's exact joint over a
few tokens, and a chi-square goodness-of-fit test."""

import torch


def exact_joint(target: dict, vocab: int, length: int) -> torch.Tensor:
    """P(t_1..t_length) of sampling the target one token at a time: `target[prefix]` is the (vocab,)
    distribution after `prefix` (a tuple); index sum(t_i * vocab^(length - 1 - i))."""
    probs = torch.zeros(vocab ** length)
    for index in range(vocab ** length):
        tokens = [(index // vocab ** (length - 1 - i)) % vocab for i in range(length)]
        p = 1.0
        for i, token in enumerate(tokens):
            p *= float(target[tuple(tokens[:i])][token])
        probs[index] = p
    return probs


def chi_square_rejects(counts: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    """Chi-square goodness of fit at significance 1e-3; cells expecting < 5 counts are pooled (an observed
    count where the target has no mass at all rejects outright)."""
    n = float(counts.sum())
    if counts[expected_probs == 0].sum() > 0:
        return True
    expected = expected_probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.09  # one-sided normal quantile of 1e-3; Wilson-Hilferty approximation of the chi-square quantile
    critical = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    print(f"chi-square {statistic:.0f}, critical {critical:.0f} ({dof} degrees of freedom)")
    return statistic > critical
