"""Linear layers with FP8 weights (`weights_dtype: fp8`): e4m3 with one scale per output channel, computed
at load from the model's own weights.

A decode step streams every weight once: stored in one byte instead of two (bf16), the stream halves. Per
output channel, s = max|w_row| / 448 (e4m3's largest finite value) and q = e4m3(w / s), so w ≈ q·s with
at most 2^-4 relative rounding per element (3 mantissa bits; subnormals lose more, within s·2^-9).

Products of up to KERNEL_ROWS rows (decode steps, verifies, small batches: where the weight stream is the
cost) run on a GPU in a weight-only Triton kernel: each program reads a tile of FP8 weights once, widens it
to the activations' dtype (exactly: every e4m3 value is a bfloat16 one) and multiplies it with every row,
the output channel's scale applied to the float32 sum; up to TILE_ROWS rows the product is split along K
so that enough programs stream at once (KernelConfig). The activations stay as they are (no activation
quantization, unlike FP8 tensor-core products, whose stock small-row GEMM streamed 1563 GB/s on an H100
against bf16's 2674: ../shared/notes/gpu.md). Larger products (prompts: compute-bound) and every product
where the kernel does not run (CPU, or a GPU where its check at load fails) dequantize the weight to the
activations' dtype and use the dense product: the same quantized model, without the speed on CPU (a way
to test and to measure what FP8 changes, not to serve). A row's result depends on its own activations and
the weights only, the same bits for every product of up to TILE_ROWS rows, so a verify's rows are a
decode step's; past TILE_ROWS, up to the kernels' summation order, as in bf16. Measured on an H200:
docs/results/2026-11-29-gpu-h200-fp8.md.

Speculation is exact with respect to the model that is served: target and draft are the quantized ones,
and target-only serving of the same weights gives the same greedy text. The vocabulary head (`lm_head`)
keeps the model's dtype, as the peers' FP8 modes keep it: it is often tied to the embedding, and the last
product decides the token.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KEEP = ("lm_head",)  # linears left in the model's dtype
KERNEL_ROWS = 128  # products of up to this many rows use the kernel (more: dequantized, compute-bound)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILE_ROWS = 16  # decode steps and verifies: one row tile, the products split along K (below)
MAX_SPLIT = 8  # K-slices of one product at most
DEQUANTIZE_BLOCK = 2048  # weights per program of the dequantizing kernel


class KernelConfig(NamedTuple):
    """The weight-only kernel's launch for products of up to TILE_ROWS rows: output channels per program,
    weights read per inner step, warps per program, software-pipeline stages of the inner loop, and the
    programs per multiprocessor the product is split along K to reach (0: no split). A program streams
    its weights alone, and one or two per multiprocessor keep too few bytes in flight to read at the
    memory's speed (the 4096-column matrices unsplit: docs/results/2026-11-29-gpu-h200-fp8.md): the K-slices'
    float32 partials are summed by the tile's last program, in slice order, so every result is the
    same bits whichever program finishes last."""

    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 3
    waves: int = 4

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """"BLOCK_N,BLOCK_K,WARPS,STAGES,WAVES" (bench/fp8_kernel_bench.py prints the fastest measured)."""
        try:
            config = cls(*(int(part) for part in text.split(",")))
        except (TypeError, ValueError):
            raise ValueError(f"{CONFIG_ENV}={text!r}: five integers BLOCK_N,BLOCK_K,WARPS,STAGES,WAVES were "
                             "expected")
        if config.block_n < 16 or config.block_k < 16 or any(v & (v - 1) for v in config[:3]) \
                or config.stages < 1 or config.waves < 0:
            raise ValueError(f"{CONFIG_ENV}={text!r}: BLOCK_N and BLOCK_K powers of two >= 16, WARPS a power "
                             "of two, STAGES >= 1, WAVES >= 0")
        return config

    def split(self, n: int, k: int, multiprocessors: int) -> tuple[int, int]:
        """(slices, columns of K per slice) for an (n, k) weight: enough programs for `waves` per
        multiprocessor, each slice at least two inner steps long."""
        wanted = _cdiv(self.waves * multiprocessors, _cdiv(n, self.block_n)) if self.waves else 1
        slices = max(1, min(MAX_SPLIT, wanted, k // (2 * self.block_k)))
        per_slice = _cdiv(_cdiv(k, slices), self.block_k) * self.block_k
        return _cdiv(k, per_slice), per_slice


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Products of TILE_ROWS+1 to KERNEL_ROWS rows (many sequences' verifies at once): row tiles of 64, unsplit
# (slower than bf16's dense product, far faster than dequantizing: the results page above).
WIDE_TILE, WIDE_LAUNCH = 64, KernelConfig(64, 128, 4, 3, 0)
CONFIG_ENV = "SPECDEC_FP8_KERNEL"  # a launch measured faster on the GPU at hand (else KernelConfig())


@functools.cache
def kernel_config() -> KernelConfig:
    """The launch of products up to TILE_ROWS rows: $SPECDEC_FP8_KERNEL where set (read once per process),
    else the default."""
    text = os.environ.get(CONFIG_ENV, "").strip()
    return KernelConfig.parse(text) if text else KernelConfig()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (q (out, in) float8_e4m3fn, scale (out,) float32) with weight ≈ q · scale[:, None]."""
    amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (weight.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale[:, None] in `dtype` (the product's float32, rounded once). On a GPU in one kernel that
    reads each FP8 weight once and writes it once (the tensor expressions' float32 temporaries made long
    prompts several times slower)."""
    if q.device.type == "cuda" and dtype in KERNEL_DTYPES and _triton_installed():
        return kernel_dequantize(q, scale, dtype)
    return (q.float() * scale[:, None]).to(dtype)


def kernel_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize's kernel: one program per row and DEQUANTIZE_BLOCK weights."""
    import triton

    out = torch.empty(q.shape, device=q.device, dtype=dtype)
    n, k = q.shape
    _dequantize_kernel()[(n, triton.cdiv(k, DEQUANTIZE_BLOCK))](q, scale, out, k, q.stride(0), out.stride(0),
                                                                BLOCK=DEQUANTIZE_BLOCK)
    return out


@functools.cache
def _dequantize_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize_rows(q_ptr, scale_ptr, out_ptr, K, stride_q, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        q = tl.load(q_ptr + row * stride_q + ks, mask=ks < K, other=0.0).to(tl.float32)
        value = q * tl.load(scale_ptr + row)
        tl.store(out_ptr + row * stride_out + ks, value.to(out_ptr.dtype.element_ty), mask=ks < K)

    return dequantize_rows


@functools.cache
def _kernel():
    """The weight-only FP8 product, defined on first use (triton imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def fp8_rows(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, per_slice,
                 stride_x, stride_w, stride_out, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SLICES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out (M, N) = x (M, K) @ (w (N, K) · scale (N,))^T + bias. Program (n, s, m): output channels
        n*BLOCK_N.., K-slice s (per_slice columns), rows m*BLOCK_M..; its weights read once for every row.
        With SLICES > 1 (M <= BLOCK_M): float32 partials in part (SLICES, BLOCK_M, N), count (tiles,) the
        slices done per tile, zero between products (the last program resets it)."""
        tile, piece = tl.program_id(0), tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        first = piece * per_slice
        last = tl.minimum(K, first + per_slice)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(first, last, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=(rows[:, None] < M) & (ks[None, :] < last), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < last), other=0.0)
            w = w.to(x.dtype)  # exact: every e4m3 value is a bfloat16, float16 and float32 one
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        done = True
        if SLICES > 1:
            part = part_ptr + rows[:, None] * N + cols[None, :]
            tl.store(part + piece * BLOCK_M * N, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))
            tl.debug_barrier()  # every thread's partial stored before the count says so (released below)
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SLICES - 1
            if done:  # the tile's last slice: sum the partials in slice order
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SLICES):
                    acc += tl.load(part + s * BLOCK_M * N, mask=(rows[:, None] < M) & (cols[None, :] < N),
                                   other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + tile, 0)
        if done:
            acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))

    return fp8_rows


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device, n: int, config: KernelConfig, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials and per-tile counts of a split product of n output channels: one pair per device and
    shape, kept for the process's life (CUDA graphs hold their addresses; the executor runs one product at a
    time per device, so products of one shape share them). reserve() makes them before graphs are captured."""
    key = (str(device), n, config.block_n, slices)
    if key not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the FP8 kernel's workspace for {n} output channels was not reserved before "
                               "CUDA graph capture (fp8_linear.reserve)")
        _workspaces[key] = (torch.empty(slices * TILE_ROWS * n, device=device, dtype=torch.float32),
                            torch.zeros(_cdiv(n, config.block_n), device=device, dtype=torch.int32))
    return _workspaces[key]


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def launch(rows: int, q: torch.Tensor, config: KernelConfig | None = None) -> tuple[KernelConfig, int, int, int]:
    """(launch, row tile, K-slices, columns per slice) of the product of `rows` rows with q (N, K)."""
    if rows > TILE_ROWS:
        return WIDE_LAUNCH, WIDE_TILE, 1, q.shape[1]
    config = config or kernel_config()
    return (config, TILE_ROWS, *config.split(q.shape[0], q.shape[1], multiprocessors(q.device)))


def reserve(model: nn.Module) -> None:
    """Make the split products' workspaces of every Fp8Linear of `model` (before CUDA graph capture)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.kernel:
            config, _, slices, _ = launch(1, module.weight)
            if slices > 1:
                workspace(module.weight.device, module.out_features, config, slices)


def kernel_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   config: KernelConfig | None = None) -> torch.Tensor:
    """x (M, K) @ (q · scale)^T + bias with the weight-only kernel; M <= KERNEL_ROWS. config: the launch of
    products up to TILE_ROWS rows (default: kernel_config())."""
    import triton

    config, tile, slices, per_slice = launch(x.shape[0], q, config)
    rows, n = x.shape[0], q.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    part, count = workspace(x.device, n, config, slices) if slices > 1 else (out, out)
    _kernel()[(triton.cdiv(n, config.block_n), slices, triton.cdiv(rows, tile))](
        x, q, scale, bias if bias is not None else scale, out, part, count, rows, n, q.shape[1], per_slice,
        x.stride(0), q.stride(0), out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        SLICES=slices, BLOCK_M=tile, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.warps,
        num_stages=config.stages)
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


@torch.no_grad()
def fuse(linears: list["Fp8Linear"]) -> "Fp8Linear":
    """One Fp8Linear for FP8 linears that read the same input (a layer's query, key and value
    projections): their weights and scales concatenated (exact: a scale per output channel), one product
    instead of several. The layers' buffers become views of it (no memory added)."""
    sizes = [m.out_features for m in linears]
    q = torch.cat([m.weight for m in linears])
    scale = torch.cat([m.weight_scale for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    shape = nn.Linear(linears[0].in_features, sum(sizes), bias=False, device="meta")
    fused = Fp8Linear(shape, kernel=linears[0].kernel, quantized=(q, scale))
    fused.bias = bias
    for m, weight, part, add in zip(linears, q.split(sizes), scale.split(sizes),
                                    bias.split(sizes) if bias is not None else [None] * len(sizes)):
        m.weight, m.weight_scale = weight, part
        if add is not None:
            m.bias = add
    if fused.kernel:
        reserve(fused)
    return fused


def kernel_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the weight-only kernel can run here (CUDA, or Triton's interpreter for tests), else why not."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "not a CUDA device"
    if dtype not in KERNEL_DTYPES:
        return f"the FP8 kernel serves {[str(d) for d in KERNEL_DTYPES]}, not {dtype}"
    if not _triton_installed():
        return "Triton is not installed"
    return None


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    if why_not is None:
        reserve(model)
    return why_not
