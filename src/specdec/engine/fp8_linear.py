"""Linear layers with FP8 weights (`weights_dtype: fp8`): e4m3 with one scale per output channel, computed
at load from the model's own weights.

A decode step streams every weight once: stored in one byte instead of two (bf16), the stream halves. Per
output channel, s = max|w_row| / 448 (e4m3's largest finite value) and q = e4m3(w / s), so w ≈ q·s with
at most 2^-4 relative rounding per element (3 mantissa bits; subnormals lose more, within s·2^-9).

Products of up to KERNEL_ROWS rows (decode steps, verifies, small batches: where the weight stream is the
cost) run on a GPU in a weight-only Triton kernel: each program reads a tile of FP8 weights once, widens it
to the activations' dtype (exactly: every e4m3 value is a bfloat16 one) and multiplies it with every row,
the output channel's scale applied to the float32 sum. The activations stay as they are (no activation
quantization, unlike FP8 tensor-core products, whose stock small-row GEMM streamed 1563 GB/s on an H100
against bf16's 2674: ../shared/notes/gpu.md). Larger products (prompts: compute-bound) and every product
where the kernel does not run (CPU, or a GPU where its check at load fails) dequantize the weight to the
activations' dtype and use the dense product: the same quantized model, without the speed on CPU (a way
to test and to measure what FP8 changes, not to serve). A row's result depends on its own activations and
the weights only, so a verify's rows are a decode step's up to the kernels' summation order, as in bf16.

Speculation is exact with respect to the model that is served: target and draft are the quantized ones,
and target-only serving of the same weights gives the same greedy text. The vocabulary head (`lm_head`)
keeps the model's dtype, as the peers' FP8 modes keep it: it is often tied to the embedding, and the last
product decides the token.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KEEP = ("lm_head",)  # linears left in the model's dtype
KERNEL_ROWS = 16  # products of up to this many rows use the kernel (one row tile)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_N, BLOCK_K = 32, 128  # output channels per program, weights read per inner step


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (q (out, in) float8_e4m3fn, scale (out,) float32) with weight ≈ q · scale[:, None]."""
    amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (weight.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale[:, None] in `dtype` (the product's float32, rounded once)."""
    return (q.float() * scale[:, None]).to(dtype)


@functools.cache
def _kernel():
    """The weight-only FP8 product, defined on first use (triton imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def fp8_rows(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
        """out (M, N) = x (M, K) @ (w (N, K) · scale (N,))^T + bias, M <= BLOCK_M: one program per BLOCK_N
        output channels reads their weights once for every row."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            w = w.to(x.dtype)  # exact: every e4m3 value is a bfloat16, float16 and float32 one
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return fp8_rows


def kernel_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ (q · scale)^T + bias with the weight-only kernel; M <= KERNEL_ROWS."""
    import triton

    rows, n = x.shape[0], q.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    _kernel()[(triton.cdiv(n, BLOCK_N),)](
        x, q, scale, bias if bias is not None else scale, out, rows, n, q.shape[1], x.stride(0), q.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=KERNEL_ROWS,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


class Fp8Linear(nn.Module):
    """y = x @ (q · scale)^T + b, q the FP8 weight (out, in), scale (out,) float32. x: (..., in_features).
    kernel: products of up to KERNEL_ROWS rows in the weight-only kernel (else all dequantized)."""

    def __init__(self, linear: nn.Linear, kernel: bool = False,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):
        """quantized: (q, scale per channel) for `linear`'s weight; default: computed from it (quantize_rows)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight) if quantized is None else quantized
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.kernel = kernel

    @classmethod
    def from_checkpoint(cls, linear: nn.Linear, q: torch.Tensor, scale: torch.Tensor) -> "Fp8Linear":
        """The layer `linear` stands for, with a checkpoint's FP8 weight q (out, in) and its scale: one per
        output channel ((out,) or (out, 1): compressed-tensors' channel strategy) or one for the whole
        tensor (a scalar or (1,): ModelOpt, compressed-tensors' tensor strategy), held per channel."""
        out, features = linear.out_features, linear.in_features
        if q.dtype != FP8 or tuple(q.shape) != (out, features):
            raise ValueError(f"an FP8 weight of shape {(out, features)} in {FP8} was expected, got "
                             f"{tuple(q.shape)} in {q.dtype}")
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(out)
        elif tuple(scale.shape) in ((out,), (out, 1)):
            scale = scale.reshape(out)
        else:
            raise ValueError(f"weight_scale of shape {tuple(scale.shape)}: one scale per output channel or one "
                             "per tensor is served, not per block or group")
        device = linear.weight.device
        return cls(linear, quantized=(q.to(device), scale.float().contiguous().to(device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.numel() <= KERNEL_ROWS * self.in_features:
            flat = x.reshape(-1, self.in_features)
            return kernel_product(flat, self.weight, self.weight_scale, self.bias).view(*x.shape[:-1], -1)
        return nn.functional.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per channel"


def kernel_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the weight-only kernel can run here (CUDA, or Triton's interpreter for tests), else why not."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "not a CUDA device"
    if dtype not in KERNEL_DTYPES:
        return f"the FP8 kernel serves {[str(d) for d in KERNEL_DTYPES]}, not {dtype}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def kernel_checks_out(device: torch.device, dtype: torch.dtype) -> str | None:
    """kernel_unavailable, then the kernel against the dequantized product on a small one (at load): None
    where it runs and agrees."""
    problem = kernel_unavailable(device, dtype)
    if problem:
        return problem
    generator = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(80, 300, generator=generator).to(device, dtype)
    x = torch.randn(5, 300, generator=generator).to(device, dtype)
    q, scale = quantize_rows(weight)
    try:
        fast = kernel_product(x, q, scale, None).float()
    except Exception as exc:  # noqa: BLE001 - any failure means the dequantized path
        return f"the FP8 kernel failed: {type(exc).__name__}: {exc}"
    slow = nn.functional.linear(x, dequantize(q, scale, dtype)).float()
    error = ((fast - slow).abs().max() / slow.abs().max()).item()
    return None if error < 0.02 else f"the FP8 kernel disagrees with the dequantized product ({error:.3f})"


@torch.no_grad()
def quantize_linears(model: nn.Module, kernel: bool | None = None, keep: tuple[str, ...] = KEEP
                     ) -> tuple[int, str | None]:
    """Replace every nn.Linear in `model` but those named in `keep` (in place) with an Fp8Linear, then
    `use_kernel`. Returns (how many, why the kernel is not used: None where it is)."""
    like = next(model.parameters())  # the activations' device and dtype (before the weights go)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in keep:
                setattr(parent, name, Fp8Linear(child))
                replaced += 1
    return replaced, use_kernel(model, kernel, like)


def use_kernel(model: nn.Module, kernel: bool | None = None, like: torch.Tensor | None = None) -> str | None:
    """Whether the model's Fp8Linears run small products in the weight-only kernel. kernel: None (auto) on
    CUDA where it checks out; True requires it (Triton's interpreter included); False never. like: a tensor
    of the activations' device and dtype (default: the model's first parameter). Returns why the kernel is
    not used (None where it is)."""
    parameter = like if like is not None else next(model.parameters())
    if kernel is False:
        why_not = "not asked for"
    elif kernel is None and parameter.device.type != "cuda":
        why_not = "not a CUDA device"  # auto never takes the interpreter
    else:
        why_not = kernel_checks_out(parameter.device, parameter.dtype)
        if kernel and why_not:
            raise ValueError(f"the FP8 kernel cannot run here: {why_not}")
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.kernel = why_not is None
    return why_not
