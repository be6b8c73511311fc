"""Linear layers on oneDNN with weights reordered once at load (CPU, float32/bfloat16).

Torch's default fp32 linear on CPU (MKL sgemm) repacks the weights on every call and has a slow path
for 2-9 rows. With the weight reordered once into oneDNN's blocked layout (what torch.compile's CPU
backend does when it freezes weights), a step is faster and a forward of K+1 rows costs about as much
as one of a single row: exactly the ratio speculative decoding and batching live on.

`prepack_linears` swaps every `nn.Linear` for `PrepackedLinear`; the numbers agree with the dense layer
to float rounding (unit-tested).
"""

from __future__ import annotations

import torch
from torch import nn

# The row count oneDNN tunes the reordered layout for; 8 measured fastest over 1-16 rows (decode steps,
# verifies of K+1 positions, batches of sequences). Prompts of hundreds of rows still run fine.
BATCH_HINT = 8
KINDS = ("auto", "onednn", "torch")


class PrepackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's reordered layout. x: (..., in_features)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def resolve(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to prepack for a `linear_kernels` setting: auto = where supported; onednn = required."""
    if kind not in KINDS:
        raise ValueError(f"linear_kernels must be one of {KINDS}, got {kind!r}")
    if kind == "onednn" and not supported(device, dtype):
        raise ValueError(f"linear_kernels=onednn needs a CPU model in float32 or bfloat16 with oneDNN, got "
                         f"{device.type} {dtype}")
    return kind == "onednn" or (kind == "auto" and supported(device, dtype))


@torch.no_grad()
def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` (in place) with a PrepackedLinear; returns how many.

    Inference only: the reordered weights are copies outside autograd (a tied head keeps its embedding).
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PrepackedLinear(child))
                replaced += 1
    return replaced
