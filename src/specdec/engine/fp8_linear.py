"""Linear layers with FP8 weights (`weights_dtype: fp8`): e4m3 with one scale per output channel, computed
at load from the model's own weights.

A decode step streams every weight once: stored in one byte instead of two (bf16), the stream halves. Per
output channel, s = max|w_row| / 448 (e4m3's largest finite value) and q = e4m3(w / s), so w ≈ q·s with
at most 2^-4 relative rounding per element (3 mantissa bits; subnormals lose more, within s·2^-9).

On a GPU with FP8 tensor cores (compute capability 8.9 or more: Ada, Hopper) a product runs as
`torch._scaled_mm` over the activations quantized per row at run time (each row's scale its own: a row's
result does not depend on the others, so a verify's rows are a decode step's, up to kernel rounding as in
bf16); the product is checked against the dequantized one at load, and falls back to it where the check
fails. Elsewhere (CPU, older GPUs) the weight is dequantized to the activations' dtype for each product:
the same numbers as the quantized model, without the speed (a way to test and to measure what FP8
changes, not to serve). Speculation is exact with respect to the model that is served: both target and
draft are the quantized ones, and target-only serving of the same weights gives the same greedy text.

The vocabulary head (`lm_head`) keeps the model's dtype, as the peers' FP8 modes keep it: it is often tied
to the embedding, and the last product decides the token.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KEEP = ("lm_head",)  # linears left in the model's dtype


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (q (out, in) float8_e4m3fn, scale (out,) float32) with weight ≈ q · scale[:, None]."""
    amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (weight.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale[:, None] in `dtype` (the product's float32, rounded once)."""
    return (q.float() * scale[:, None]).to(dtype)


def _scaled_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, in) @ (q · scale)^T on FP8 tensor cores: x quantized per row, rows padded to a multiple of 16."""
    rows = x.shape[0]
    padded = -(-rows // 16) * 16
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    x_q = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if padded != rows:
        x_q = torch.cat([x_q, x_q.new_zeros(padded - rows, x_q.shape[1])])
        x_scale = torch.cat([x_scale, x_scale.new_ones(padded - rows, 1)])
    out = torch._scaled_mm(x_q, q.t(), scale_a=x_scale, scale_b=scale[None], out_dtype=x.dtype)
    out = out[:rows]
    return out if bias is None else out + bias


class Fp8Linear(nn.Module):
    """y = x @ (q · scale)^T + b, q the FP8 weight (out, in), scale (out,) float32. x: (..., in_features)."""

    def __init__(self, linear: nn.Linear, tensor_cores: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.tensor_cores = tensor_cores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tensor_cores:
            flat = x.reshape(-1, self.in_features)
            return _scaled_product(flat, self.weight, self.weight_scale, self.bias).view(*x.shape[:-1], -1)
        return nn.functional.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per channel"


def tensor_cores_work(device: torch.device, dtype: torch.dtype) -> str | None:
    """None where `_scaled_product` runs and agrees with the dequantized product on this device, else why
    not (checked once at load on a small product)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability(device)} has no FP8 tensor cores"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FP8 products write bfloat16 or float16, the model is {dtype}"
    generator = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(64, 128, generator=generator).to(device, dtype)
    x = torch.randn(3, 128, generator=generator).to(device, dtype)
    q, scale = quantize_rows(weight)
    try:
        fast = _scaled_product(x, q, scale, None).float()
    except Exception as exc:  # noqa: BLE001 - any failure means the dequantized path
        return f"torch._scaled_mm failed: {type(exc).__name__}: {exc}"
    slow = nn.functional.linear(x, dequantize(q, scale, dtype)).float()
    error = ((fast - slow).abs().max() / slow.abs().max()).item()
    return None if error < 0.1 else f"torch._scaled_mm disagrees with the dequantized product ({error:.3f})"


@torch.no_grad()
def quantize_linears(model: nn.Module, keep: tuple[str, ...] = KEEP) -> tuple[int, str | None]:
    """Replace every nn.Linear in `model` but those named in `keep` (in place) with an Fp8Linear. Returns
    (how many, why FP8 tensor cores are not used: None where they are)."""
    parameter = next(model.parameters())
    why_not = tensor_cores_work(parameter.device, parameter.dtype)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in keep:
                setattr(parent, name, Fp8Linear(child, tensor_cores=why_not is None))
                replaced += 1
    return replaced, why_not
