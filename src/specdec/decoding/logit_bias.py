"""vLLM's and OpenAI's token-level settings: `logit_bias` (added to chosen tokens' logits) and
`allowed_token_ids` (every other token excluded).

Both change every position's logits alike, before penalties, bans, the grammar, and sampling's processing,
as vLLM orders them. They apply to the target's logits only: the draft proposes without them, and
rejection sampling stays exact for any draft distribution (a biased request may accept fewer drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

MAX_ABS_BIAS = 100.0  # OpenAI's range, [-100, 100]: -100 all but bans a token, 100 all but forces it


@dataclass(frozen=True)
class TokenBias:
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed: frozenset[int] | None = None  # None: every token

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.allowed is not None

    # As tensors, built once per request (a list of thousands of allowed ids costs milliseconds per round).
    @cached_property
    def allowed_ids(self) -> torch.Tensor:
        return torch.tensor(sorted(self.allowed or ()), dtype=torch.long)

    @cached_property
    def bias_ids_and_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([token for token, _ in self.bias], dtype=torch.long),
                torch.tensor([bias for _, bias in self.bias], dtype=torch.float32))


def apply_bias(logits: torch.Tensor, token_bias: TokenBias) -> torch.Tensor:
    """logits [P, V] with the biases added and the tokens outside `allowed` at -inf (a copy; ids at or
    beyond V are ignored: the model cannot produce them). Half-precision logits are computed in float32."""
    out = logits.float().clone()
    width = out.shape[-1]
    if token_bias.allowed is not None:
        ids = token_bias.allowed_ids
        keep = torch.zeros(width, dtype=torch.bool)
        keep[ids[ids < width]] = True
        out.masked_fill_(~keep.to(out.device), float("-inf"))
    ids, values = token_bias.bias_ids_and_values
    inside = ids < width
    if inside.any():
        out[:, ids[inside].to(out.device)] += values[inside].to(out.device)
    return out
