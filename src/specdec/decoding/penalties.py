"""Repetition, presence and frequency penalties on the target's logits (vLLM's and OpenAI's rules, the
names TensorRT-LLM's and vLLM's clients send).

At a position whose preceding tokens are prompt + generated, a token's logit l becomes
    l / r  (l > 0)  or  l * r  (l <= 0)         if the token occurs in prompt + generated  (repetition r)
    then  - f * count - p * [count > 0]           count: its occurrences in generated  (frequency f, presence p)
before temperature, top-k and top-p (and before the greedy argmax). The repetition rule is transformers'
`repetition_penalty`; presence and frequency count generated tokens only, as vLLM and OpenAI do.

Speculation stays exact: verify position j penalises with the round's drafts x_1..x_j as generated
tokens, exactly what target-only decoding would have generated before it had it accepted them. The draft
needs no penalties for the accept/reject rule to stay exact (it would only be accepted more often).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec import tensor_names as tn


@dataclass(frozen=True)
class Penalties:
    repetition: float = tn.DEFAULT_REPETITION_PENALTY  # r > 0; 1 = off
    presence: float = tn.DEFAULT_PRESENCE_PENALTY  # p; 0 = off
    frequency: float = tn.DEFAULT_FREQUENCY_PENALTY  # f; 0 = off

    @property
    def active(self) -> bool:
        return (self.repetition != tn.DEFAULT_REPETITION_PENALTY or self.presence != tn.DEFAULT_PRESENCE_PENALTY
                or self.frequency != tn.DEFAULT_FREQUENCY_PENALTY)


def penalize(logits: torch.Tensor, prompt: Sequence[int], generated: Sequence[int], draft: Sequence[int],
             penalties: Penalties) -> torch.Tensor:
    """logits [P, V] of a verify's P positions, penalised (a new tensor; half precisions computed in float32).

    Position j follows prompt + generated + draft[:j]; draft needs at least P - 1 tokens. Ids >= V (none
    a model produces) are ignored."""
    positions, width = logits.shape
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    device = logits.device
    # counts[j, t]: occurrences of t among generated + draft[:j]; the drafts add one token per position.
    history = torch.tensor([t for t in generated if t < width], dtype=torch.long)
    counts = torch.bincount(history, minlength=width).to(device=device, dtype=logits.dtype).repeat(positions, 1)
    steps = [(j, token) for j in range(1, positions) for token in draft[:j] if token < width]
    if steps:
        rows, cols = (torch.tensor(column, dtype=torch.long, device=device) for column in zip(*steps))
        counts.index_put_((rows, cols), torch.ones(len(steps), dtype=logits.dtype, device=device), accumulate=True)
    out = logits
    if penalties.repetition != tn.DEFAULT_REPETITION_PENALTY:
        seen = counts > 0
        in_prompt = torch.tensor(sorted({t for t in prompt if t < width}), dtype=torch.long, device=device)
        seen[:, in_prompt] = True
        penalised = torch.where(out > 0, out / penalties.repetition, out * penalties.repetition)
        out = torch.where(seen, penalised, out)
    if penalties.frequency != tn.DEFAULT_FREQUENCY_PENALTY:
        out = out - penalties.frequency * counts
    if penalties.presence != tn.DEFAULT_PRESENCE_PENALTY:
        out = out - penalties.presence * (counts > 0).to(out.dtype)
    return out
