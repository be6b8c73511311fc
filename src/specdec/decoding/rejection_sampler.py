"""The accept/reject rule of speculative decoding, as pure functions with randomness passed in.

Given K draft tokens x_1..x_K drawn from draft distributions p_d and the target's distributions p_t at
the K+1 positions [after the prefix, after x_1, ..., after x_K] (one target forward pass):
  accept x_i while u_i < p_t(x_i) / p_d(x_i), u_i ~ U[0, 1) (probability min(1, p_t / p_d));
  at the first rejection, sample the next token from normalize(max(0, p_t - p_d)) and stop;
  if all K are accepted, sample a bonus token from p_t at position K+1.
Every round emits between 1 and K+1 tokens and the output is distributed exactly as the target's
(Leviathan et al. 2023, Theorem 1). Greedy decoding is the special case of one-hot distributions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.decoding.sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # leading draft tokens accepted, 0..K
    next_token: int  # the target's correction (on rejection) or bonus token (all accepted)


def greedy_verify(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """Greedy rule: accept while the draft equals the target's argmax, then emit the target's argmax.

    draft_tokens: K token ids; target_argmax: K+1, argmax of the target at each verified position. Lists
    (what the loop passes: K <= 16 ints compare faster in Python than through tensor ops, which cost
    microseconds each on every round) or 1-D tensors.
    """
    draft, target = [int(t) for t in draft_tokens], [int(t) for t in target_argmax]
    k = len(draft)
    assert len(target) == k + 1, "target must score K+1 positions"
    num_accepted = next((i for i in range(k) if draft[i] != target[i]), k)
    return Verdict(num_accepted, target[num_accepted])


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Lossless stochastic rule.

    draft_tokens: (K,) int, drawn from draft_probs.
    draft_probs: (K, V) draft distributions the tokens were drawn from (after sampling processing).
    target_probs: (K+1, V) target distributions after identical processing.
    uniforms: (K,) U[0, 1) draws, one per draft token (passed in so tests control randomness).
    generator: used only for the single correction / bonus draw.
    All tensors on one device (the target's logits stay where the target computed them).
    """
    k = draft_tokens.shape[0]
    assert draft_probs.shape[0] == k and target_probs.shape[0] == k + 1
    positions = torch.arange(k, device=draft_tokens.device)
    p_target = target_probs[positions, draft_tokens]
    p_draft = draft_probs[positions, draft_tokens]
    # Accept iff u < p_t / p_d (probability min(1, p_t / p_d) for u ~ U[0, 1)), written without the
    # division: p_t >= p_d always accepts, and a token the target gives no mass is always rejected.
    rejected = (uniforms * p_draft >= p_target).nonzero()
    if not rejected.numel():
        return Verdict(k, int(sample(target_probs[k], generator)))
    first = int(rejected[0, 0])
    residual = (target_probs[first] - draft_probs[first]).clamp_min(0)
    total = residual.sum()
    if total <= 0:
        # Only reachable through rounding when p_t == p_d (then rejection has probability 0): fall
        # back to the target distribution itself, which is what the residual converges to.
        residual, total = target_probs[first], target_probs[first].sum()
    return Verdict(first, int(sample(residual / total, generator)))
