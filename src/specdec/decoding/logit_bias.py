"""vLLM's and OpenAI's token-level settings: `logit_bias` (added to chosen tokens' logits) and
`allowed_token_ids` (every other token excluded).

Both change every position's logits alike, before penalties, bans, the grammar, and sampling's processing,
as vLLM orders them. They apply to the target's logits only: the draft proposes without them, and
rejection sampling stays exact for any draft distribution (a biased request may accept fewer drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ABS_BIAS = 100.0  # OpenAI's range, [-100, 100]: -100 all but bans a token, 100 all but forces it


@dataclass(frozen=True)
class TokenBias:
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed: frozenset[int] | None = None  # None: every token

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.allowed is not None


def apply_bias(logits: torch.Tensor, token_bias: TokenBias) -> torch.Tensor:
    """logits [P, V] with the biases added and the tokens outside `allowed` at -inf (a copy; ids at or
    beyond V are ignored: the model cannot produce them). Half-precision logits are computed in float32."""
    out = logits.float().clone()
    width = out.shape[-1]
    if token_bias.allowed is not None:
        keep = torch.zeros(width, dtype=torch.bool)
        keep[[token for token in token_bias.allowed if token < width]] = True
        out.masked_fill_(~keep.to(out.device), float("-inf"))
    pairs = [(token, bias) for token, bias in token_bias.bias if token < width]
    if pairs:
        ids = torch.tensor([token for token, _ in pairs], device=out.device)
        out[:, ids] += torch.tensor([bias for _, bias in pairs], dtype=out.dtype, device=out.device)
    return out
