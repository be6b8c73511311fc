"""The weight-only FP8 kernel's launches against bf16's dense product, per weight kind of the 8B-shaped
target (`bash bench/gpu_session.sh fp8` runs it before the served rows).

Issue 47 asks for served target-only <= 3.8 ms with FP8 weights: the weight stream halves only where the
kernel reads FP8 at the speed cuBLAS reads bf16. For each launch of products up to 16 rows (KernelConfig:
output channels per program, weights per inner step, warps, pipeline stages, programs per multiprocessor
the product is split along K to reach) and each weight kind of the pair (qkv fused, o_proj, gate_up
fused, down_proj; `--matrices` distinct random matrices of each, so the weights come from memory and not
from L2), the products of 1, 5 and 16 rows are timed as one CUDA graph, and those of 40 and 128 rows (the
wide tiles) and 480 (dequantized) beside bf16's; every launch is checked against the dequantized product
and for the same bits on every call first. Printed: µs per matrix and GB/s (the FP8 bytes read; bf16's
for the dense rows), then the launches by their time over every kind and row count, the fastest last as
the value of SPECDEC_FP8_KERNEL that serves with it (`best: ...`).

    python -m bench.fp8_kernel_bench --out fp8-kernel.md           # on a GPU machine
    TRITON_INTERPRET=1 python -m bench.fp8_kernel_bench --small    # checks the script on CPU
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

from bench import gpu_bench, kernel_profile, report
from specdec.engine import fp8_linear
from specdec.engine.fp8_linear import KernelConfig

ROWS = (1, 5, 16)  # the swept launches' row counts
WIDE_ROWS = (40, 128)  # the wide tiles' (8 sequences' verifies of 5 rows; KERNEL_ROWS)
PROMPT_ROWS = 480  # dequantized, then the dense product


def kinds(small: bool) -> dict[str, tuple[int, int]]:
    """Weight kind -> (out, in) of the pair's target (tiny stand-ins with --small)."""
    if small:
        return {"qkv (fused)": (96, 64), "down_proj": (64, 160)}
    shape = gpu_bench.SHAPES["8b"]
    head = shape.hidden // shape.heads
    return {"qkv (fused)": (shape.hidden + 2 * shape.kv_heads * head, shape.hidden),
            "o_proj": (shape.hidden, shape.hidden), "gate_up (fused)": (2 * shape.mlp, shape.hidden),
            "down_proj": (shape.hidden, shape.mlp)}


def launches(small: bool) -> list[KernelConfig]:
    """The launches swept for products of up to TILE_ROWS rows (the default first)."""
    if small:
        return [KernelConfig(), KernelConfig(16, 64, 2, 2, 8), KernelConfig(32, 128, 4, 3, 0)]
    swept = [KernelConfig(n, k, 4, s, waves) for n, k, s, waves in
             itertools.product((16, 32), (128, 256, 512), (3, 4), (0, 2, 4, 8))]
    return [KernelConfig()] + [config for config in swept if config != KernelConfig()]


def dense(weights: list[torch.Tensor], x: torch.Tensor):
    """The dense products of x with each weight, as one call to time."""
    def products():
        for w in weights:
            F.linear(x, w)
    return products


def timed(fn, device: str, reps: int = 20) -> float:
    """Median seconds of fn(): one CUDA graph replay on a GPU, a plain call elsewhere."""
    if device == "cuda":
        return kernel_profile.graph_time(fn, reps)
    fn()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrices", type=int, default=8, help="distinct matrices of each kind")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    parser.add_argument("--out", help="also write the report (Markdown) here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # Triton's interpreter: float32
    why_not = fp8_linear.kernel_unavailable(torch.device(device), dtype)
    if why_not:
        print(f"fp8_kernel_bench: the kernel cannot run here: {why_not}", file=sys.stderr)
        return 2
    generator = torch.Generator(device=device).manual_seed(0)
    rows, totals, failed = [], {}, {}
    for name, (out_features, in_features) in kinds(args.small).items():
        weights = [torch.randn(out_features, in_features, device=device, dtype=dtype, generator=generator)
                   for _ in range(args.matrices)]
        quantized = [fp8_linear.quantize_rows(w) for w in weights]
        fp8_bytes = out_features * in_features
        dense_bytes = fp8_bytes * weights[0].element_size()
        for n in ROWS:
            x = torch.randn(n, in_features, device=device, dtype=dtype, generator=generator)
            seconds = timed(dense(weights, x), device) / len(weights)
            rows.append([name, n, f"{str(dtype)[6:]} dense", f"{seconds * 1e6:.1f}",
                         f"{dense_bytes / seconds / 1e9:.0f}"])
            reference = F.linear(x, fp8_linear.dequantize(*quantized[0], dtype)).float()
            for config in launches(args.small):
                if config in failed:
                    continue
                try:
                    got = fp8_linear.kernel_product(x, *quantized[0], None, config).float()
                    error = ((got - reference).abs().max() / reference.abs().max()).item()
                    if error > 0.02:
                        raise AssertionError(f"differs from the dequantized product by {error:.3f}")
                    again = [fp8_linear.kernel_product(x, *quantized[0], None, config) for _ in range(5)]
                    if not all(torch.equal(got, a.float()) for a in again):
                        raise AssertionError("not the same bits on every call")

                    def fp8():
                        for q, scale in quantized:
                            fp8_linear.kernel_product(x, q, scale, None, config)

                    seconds = timed(fp8, device) / len(quantized)
                except Exception as error:  # noqa: BLE001 - a launch that fails is reported, the rest go on
                    failed[config] = f"{type(error).__name__}: {str(error)[:200]}"
                    totals.pop(config, None)
                    continue
                totals[config] = totals.get(config, 0.0) + seconds
                rows.append([name, n, "fp8 " + ",".join(map(str, config)), f"{seconds * 1e6:.1f}",
                             f"{fp8_bytes / seconds / 1e9:.0f}"])
        for n in WIDE_ROWS + (PROMPT_ROWS,):
            x = torch.randn(n, in_features, device=device, dtype=dtype, generator=generator)
            shape = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
            layers = [fp8_linear.Fp8Linear(shape, kernel=True, quantized=pair) for pair in quantized]

            def fp8():
                for layer in layers:
                    layer(x)

            reference = F.linear(x, fp8_linear.dequantize(*quantized[0], dtype)).float()
            error = ((layers[0](x).float() - reference).abs().max() / reference.abs().max()).item()
            if error > 0.02:
                raise AssertionError(f"{name}, {n} rows: differs from the dequantized product by {error:.3f}")
            path = "fp8 kernel, wide tiles" if n <= fp8_linear.KERNEL_ROWS else "fp8 dequantized + dense"
            for label, fn, nbytes in ((f"{str(dtype)[6:]} dense", dense(weights, x), dense_bytes),
                                      (path, fp8, fp8_bytes)):
                seconds = timed(fn, device) / len(weights)
                rows.append([name, n, label, f"{seconds * 1e6:.1f}", f"{nbytes / seconds / 1e9:.0f}"])
        del weights, quantized
    ranked = sorted(totals.items(), key=lambda item: item[1])
    default = KernelConfig()
    lines = [f"# The weight-only FP8 kernel's launches against bf16\n\n{report.machine()}; {args.matrices} "
             "distinct matrices per kind, each launch's products as one CUDA graph; launch = "
             "BLOCK_N,BLOCK_K,WARPS,STAGES,WAVES (SPECDEC_FP8_KERNEL) for up to 16 rows; more rows: "
             f"row tiles of {fp8_linear.WIDE_TILE} up to {fp8_linear.KERNEL_ROWS} rows, then dequantized",
             report.table(rows, ["matrix", "rows", "product", "µs per matrix", "GB/s"]),
             "## Launches by their time over every kind and row count (µs, one matrix of each kind per row count)",
             report.table([[",".join(map(str, c)), f"{t * 1e6:.1f}", "yes" if c == default else ""]
                           for c, t in ranked], ["launch", "µs", "default"])]
    if failed:
        lines.append("## Launches that failed\n\n" + "\n".join(f"- {','.join(map(str, c))}: {why}"
                                                                for c, why in failed.items()))
    text = "\n\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if ranked:
        print("best: " + ",".join(map(str, ranked[0][0])))
    return 0 if ranked else 1


if __name__ == "__main__":
    sys.exit(main())
