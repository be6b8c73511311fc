"""Allowed-token bitmasks (structured output's masks, grammar.GrammarMatcher.allowed) read where the logits are.

A mask row is (words,) int32, bit i of word w allowing token 32 w + i: 1/32 of a bool row, which is what
crosses processes and devices (the orchestrator sends it with a verify; target_model picks with it). No
llguidance here: target_model imports this module and not the grammar.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.decoding.sampling import greedy


def unpack_allowed(bits: torch.Tensor, width: int) -> torch.Tensor:
    """bits [P, W] int32 bitmask (GrammarMatcher.allowed) -> [P, width] bool, on the bits' device; columns
    past 32 W (a padded head) are not allowed."""
    allowed = _unpack_on_host(bits) if bits.device.type == "cpu" else _unpack_on_device(bits)
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    return torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)


def _unpack_on_host(bits: torch.Tensor) -> torch.Tensor:
    # numpy's bit unpacking: on CPU faster than the tensor ops of _unpack_on_device (which build a
    # [P, W, 32] int32 intermediate). Little-endian words, little-endian bits: bit i of word w is token 32 w + i.
    return torch.from_numpy(np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")).view(torch.bool)


def _unpack_on_device(bits: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)


def mask_disallowed(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [P, V] with every token the bitmask `bits` [P, W] (GrammarMatcher.allowed) leaves out set to -inf
    (a copy). The bitmask, 1/32 of a bool mask, is what crosses to the logits' device; it unpacks there."""
    return logits.masked_fill(~unpack_allowed(bits.to(logits.device, non_blocking=True), logits.shape[1]),
                              float("-inf"))


def allowed_greedy(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row among the tokens the bitmask allows: logits [P, V], bits [P, W] ->
    [P] int64, on the logits' device (greedy over mask_disallowed's copy: the same first maximum)."""
    return greedy(mask_disallowed(logits, bits))
