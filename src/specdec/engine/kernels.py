"""The pointwise work of a Llama-family layer as pure functions, and their compiled form.

Eagerly each of these is several kernels (an RMSNorm is a cast, a square, a mean, an add, an rsqrt, a
product, a cast back and the weight's product), every layer runs them all around its matrix products,
and inside a CUDA graph each kernel still costs its launch slot and a round trip through memory.
`compiled()` hands back the same functions through `torch.compile` (inductor, automatic dynamic shapes:
one kernel each, for every bucket), which the static executor captures into its graphs like any other
kernel. The math is the model's own (transformers' LlamaRMSNorm and rotary embedding): eagerly these
give its results; compiled, the same up to the rounding of fused float arithmetic.

Shapes: N rows (a forward's B x T tokens, flattened), H hidden, heads x D per head, I the MLP's width.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H), weight (H,) -> (..., H): in float32, rounded to x's dtype before the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual, update (N, H) -> (residual + update, its RMSNorm): a layer's residual add and the next
    norm in one pass."""
    residual = residual + update
    return residual, rms_norm(residual, weight, eps)


def rotate_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
              eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv (N, (heads + 2 kv_heads) D): a layer's fused query/key/value projection; cos/sin (N, D) ->
    queries (N, heads, D) and keys (N, kv_heads, D), contiguous, with the rotary embedding applied (after
    a per-head RMSNorm where the model has one: Qwen3's q_norm / k_norm weights (D,))."""
    n, d = qkv.shape[0], cos.shape[-1]
    q = qkv[:, :heads * d].view(n, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(n, kv_heads, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = cos[:, None], sin[:, None]
    half = d // 2

    def rope(x: torch.Tensor) -> torch.Tensor:
        return (x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin).contiguous()

    return rope(q), rope(k)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (N, 2I): a SiLU MLP's fused gate and up projections -> silu(gate) * up (N, I), the input of
    its down projection (transformers' LlamaMLP computes the same from two products)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# Round bfloat16/float16 intermediates where the eager code rounds them (inductor otherwise keeps a fused
# kernel's intermediates in float32). The float32 arithmetic of the norm still rounds differently once
# fused (reduction order, rsqrt): ~1e-6 on the logits of the tests' float64 model, whose norm, like
# transformers', computes in float32.
OPTIONS = {"emulate_precision_casts": True}


class Kernels(NamedTuple):
    rms_norm: Callable
    add_rms_norm: Callable
    rotate_qk: Callable
    silu_mul: Callable


EAGER = Kernels(rms_norm, add_rms_norm, rotate_qk, silu_mul)


def cpu(device: torch.device, dtype: torch.dtype) -> Kernels | None:
    """The same functions as one compiled CPU call each (csrc/cpu_layer.cpp, built with the panel kernel:
    no torch.compile, nothing to warm up), for float32 on the CPU; None where they do not serve (another
    device or dtype, no compiler). Qwen3's per-head norms take the eager path."""
    from specdec.engine import panel_linear

    if not panel_linear.supported(device, dtype) or (module := panel_linear.build().module) is None:
        return None

    def rotate(qkv, cos, sin, heads, kv_heads, q_norm=None, k_norm=None, eps=0.0):
        if q_norm is not None:
            return rotate_qk(qkv, cos, sin, heads, kv_heads, q_norm, k_norm, eps)
        return tuple(module.rotate_qk(qkv, cos, sin, heads, kv_heads))

    return Kernels(module.rms_norm, lambda *args: tuple(module.add_rms_norm(*args)), rotate, module.silu_mul)


def cache_counts() -> tuple[int, int]:
    """This process's kernels compiled so far and those loaded from inductor's on-disk cache (its FX graph
    cache misses and hits). The cache lives in TORCHINDUCTOR_CACHE_DIR (`cache_location`): where it outlives
    the process (a volume), a new server loads instead of compiling."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]


def cache_location() -> str:
    """Where inductor caches compiled kernels: TORCHINDUCTOR_CACHE_DIR, or its default under the temporary
    directory; or that its cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0: then nothing counts)."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return f"in {cache_dir()}" if config.fx_graph_cache else "off"


def compiled() -> Kernels:
    """The functions through torch.compile (inductor; one fused kernel each). They compile on first
    use: the executor warms them up before it captures anything (`StaticForward.fuse`). The first call
    with one row compiles for one row; the first with more compiles once for any number of rows
    (torch.compile's automatic dynamic shapes): every other size is a constant of the model."""
    # Dynamo keeps one budget of recompiles per function for the whole process, and each model's sizes and
    # dtype, and no_grad against inference_mode, are guards of their own: a process with several executors
    # (a target and its draft in a bench, the GPU tests' models in two dtypes) passed the default of 8, and
    # the kernels of the executor built last stayed eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return Kernels(*(torch.compile(fn, fullgraph=True, options=OPTIONS) for fn in EAGER))
