"""Where the 8B-shaped target's step goes on a GPU, kernel by kernel (`bash bench/gpu_session.sh kernels`).

Issue 47 asks for the in-process decode step near the weight-streaming bound. This script measures, on the
synthetic 8B-shaped bf16 target of the GPU notes (random weights, seed 0, built in memory: nothing is
written to disk):

  steps      the static executor's `extend` of 1 and K+1 rows after --context tokens, its captured graph
             replayed alone (the device's share), and the bound (weight bytes / read bandwidth)
  kernels    torch.profiler over replays of those graphs: device time per step by kernel and by kind
             (matrix products, attention, KV gather/scatter, fused pointwise, copies), kernels per step, and
             the time between kernels (a step's span less its kernels' sum)
  gemm       each weight kind's product alone over the model's 32 distinct matrices, one graph each, at 1,
             5 and 16 rows: microseconds per matrix and GB/s, with cuBLAS and with cuBLASLt
  attention  the decode attention of one layer (8 KV heads x 4 query heads, head size 128) over windows of
             256-4096 keys, with each SDPA backend that takes a boolean mask, and the window's gather

Every section runs on its own: one that fails prints why and the others still report.

    python -m bench.kernel_profile --out kernels.md      # on a GPU machine
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from bench import gpu_bench, report

VOCAB = 49152  # SmolLM2's tokenizer, as the GPU bench's pair


def build_target(dtype: torch.dtype, device: str):
    """The 8B-shaped target of gpu_bench.build_pair, in memory (same config, seed and residual scale)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = gpu_bench.SHAPES["8b"]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=shape.mlp,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no float32 copy of 30 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(gpu_bench.RESIDUAL_SCALE)
            layer.mlp.down_proj.weight.mul_(gpu_bench.RESIDUAL_SCALE)
    return model.eval()


def read_bandwidth() -> float:
    """Bytes per second of a sum over 4 GiB (reads only, as a decode step's weights are)."""
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").fill_(1)
    seconds = gpu_bench.timed(lambda: x.sum(dtype=torch.float32), "cuda", 10)
    return x.numel() * x.element_size() / seconds


def graph_time(fn, reps: int = 30) -> float:
    """Median seconds of one replay of fn() captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_bench.timed(graph.replay, "cuda", reps)


KINDS = (("gemm", ("gemm", "gemv", "cutlass", "xmma", "cublas", "splitk", "sm90", "sm80", "ampere", "hopper")),
         ("attention", ("fmha", "attention", "flash", "efficient", "softmax", "cudnn")),
         ("fused pointwise (inductor)", ("triton",)),
         ("KV gather / scatter", ("index", "gather", "scatter", "put")),
         ("copy / fill", ("copy", "fill", "memcpy", "memset", "cat")),
         ("reduce", ("reduce",)))


def kind(name: str) -> str:
    lowered = name.lower()
    for label, keys in KINDS:
        if any(key in lowered for key in keys):
            return label
    return "other elementwise"


def profile_replays(graph_run, steps: int) -> tuple[list, float, int]:
    """(rows: kernel, kind, calls per step, µs per step), the mean span per step (µs: first kernel's start
    to last kernel's end, over `steps` back-to-back replays / steps) and kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph_run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            graph_run()
        torch.cuda.synchronize()
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    starts, ends = [], []
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        if name.startswith("cudaGraph") or "Memcpy" in name and "DtoH" in name:
            continue
        duration = event.time_range.end - event.time_range.start
        totals[name][0] += 1
        totals[name][1] += duration
        starts.append(event.time_range.start)
        ends.append(event.time_range.end)
    if not starts:
        return [], 0.0, 0
    rows = sorted(((name, kind(name), calls / steps, us / steps) for name, (calls, us) in totals.items()),
                  key=lambda row: -row[3])
    span = (max(ends) - min(starts)) / steps
    return rows, span, round(sum(calls for calls, _ in totals.values()) / steps)


def section(title: str, body, out: list[str]) -> None:
    gpu_bench.log(title)
    started = time.perf_counter()
    try:
        text = body()
    except Exception:  # noqa: BLE001: a section that fails says why; the others still report
        text = "failed:\n\n```\n" + traceback.format_exc()[-3000:] + "```"
    out.append(f"## {title}\n\n{text}\n\n({time.perf_counter() - started:.0f} s)")
    print(out[-1], flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="kernels listed per step")
    parser.add_argument("--attention", default="auto", choices=("auto", "paged", "sdpa"),
                        help="the static executor's attention (auto: the paged kernel on CUDA)")
    parser.add_argument("--out", help="also write the report (Markdown) here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_profile needs a CUDA device", file=sys.stderr)
        return 2
    from specdec.engine.build import static_executor
    from specdec.engine.static_forward import bucket

    out: list[str] = [f"# The 8B-shaped target's step, kernel by kernel\n\n{report.machine()}; context "
                      f"{args.context}, bf16, static executor (CUDA graphs, fused pointwise kernels and MLP)"]
    model = build_target(torch.bfloat16, "cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        model.model.embed_tokens.weight.numel() * 2  # the embedding is read one row per token
    widths = [1, args.k + 1]
    lm = static_executor(model, max_sequences=2, max_context=args.context + 64, max_batch=1, max_rows=max(widths),
                         prefix_caching=False, log=gpu_bench.log, attention=args.attention)
    lm.warm_up()
    out[0] += f", attention {lm.forward.llama.attention}"
    prompt = torch.randint(0, VOCAB, (args.context,)).tolist()
    lm.extend(1, 0, prompt, 1)
    forward = lm.forward

    def graph_for(width: int):
        blocks = -(-(args.context + width) // forward.pool.block_size)
        return forward.captured[(1, bucket(width, forward.row_sizes), bucket(blocks, forward.window_sizes))]

    def steps() -> str:
        bandwidth = read_bandwidth()
        rows = [["bound (weights / read bandwidth)", f"{weight_bytes / bandwidth * 1e3:.3f}",
                 f"{weight_bytes / 1e9:.2f} GB at {bandwidth / 1e9:.0f} GB/s"]]
        for width in widths:
            extend = gpu_bench.timed(lambda: lm.extend(1, args.context, prompt[:width], width), "cuda", 50)
            replay = gpu_bench.timed(graph_for(width).run, "cuda", 50)
            rows.append([f"{width} row(s): extend / replay alone", f"{extend * 1e3:.3f} / {replay * 1e3:.3f}",
                         f"{weight_bytes / replay / 1e9:.0f} GB/s in the replay"])
        return report.table(rows, ["what", "ms", "note"])

    def kernels() -> str:
        parts = []
        for width in widths:
            captured = graph_for(width)
            rows, span, count = profile_replays(captured.run, args.profile_steps)
            if not rows:  # no kernels traced inside graphs: the same kernels launched eagerly
                parts.append(f"{width} row(s): the profiler saw no kernels inside the graph replays; the same "
                             f"forward launched eagerly instead (its span includes launch gaps)")
                rows, span, count = profile_replays(lambda: forward.llama(captured.inputs), args.profile_steps)
            busy = sum(row[3] for row in rows)
            by_kind: dict[str, float] = collections.defaultdict(float)
            for _, label, _, us in rows:
                by_kind[label] += us
            kinds = [[label, f"{us:.0f}", f"{us / span:.1%}"] for label, us in sorted(by_kind.items(), key=lambda kv: -kv[1])]
            kinds.append(["between kernels (span - sum)", f"{span - busy:.0f}", f"{(span - busy) / span:.1%}"])
            parts.append(f"**{width} row(s)**: span {span:.0f} µs per step, {count} kernels, kernels busy "
                         f"{busy:.0f} µs\n\n" + report.table(kinds, ["kind", "µs per step", "share of span"]))
            top = [[name[:110], label, f"{calls:g}", f"{us:.1f}", f"{us / calls:.2f}"]
                   for name, label, calls, us in rows[:args.top]]
            parts.append(report.table(top, ["kernel", "kind", "calls per step", "µs per step", "µs per call"]))
        return "\n\n".join(parts)

    def gemm() -> str:
        body = model.model
        llama = forward.llama
        kinds = {
            "qkv (fused)": [w for w, _ in llama.qkv],
            "o_proj": [layer.self_attn.o_proj.weight for layer in body.layers],
            "gate_up (fused)": [pair[0] for pair in llama.gate_up] if all(llama.gate_up) else
            [layer.mlp.gate_proj.weight for layer in body.layers],
            "down_proj": [layer.mlp.down_proj.weight for layer in body.layers],
            "lm_head": [model.lm_head.weight],
        }
        rows, original = [], torch.backends.cuda.preferred_blas_library()
        for library in ("cublas", "cublaslt"):
            try:
                torch.backends.cuda.preferred_blas_library(library)
            except Exception as error:  # noqa: BLE001
                rows.append([library, f"not selectable: {error}", "", "", ""])
                continue
            for name, weights in kinds.items():
                for n in (1, 5, 16):
                    x = torch.randn(n, weights[0].shape[1], dtype=torch.bfloat16, device="cuda")

                    def products():
                        for w in weights:
                            F.linear(x, w)

                    seconds = graph_time(products) / len(weights)
                    nbytes = weights[0].numel() * 2
                    rows.append([library, name, f"{tuple(weights[0].shape)}", n, f"{seconds * 1e6:.1f}",
                                 f"{nbytes / seconds / 1e9:.0f}"])
        torch.backends.cuda.preferred_blas_library(original)
        return report.table(rows, ["library", "matrix", "weight (out, in)", "rows", "µs per matrix", "GB/s"])

    def attention() -> str:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        rows = []
        kv_heads, groups, d, block = 8, 4, 128, forward.pool.block_size
        pool_blocks = 4096
        pool = torch.randn(pool_blocks, block, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        for t in (1, args.k + 1):
            for window in (256, 1024, 4096):
                q = torch.randn(1, kv_heads, groups * t, d, dtype=torch.bfloat16, device="cuda")
                k = torch.randn(1, kv_heads, window, d, dtype=torch.bfloat16, device="cuda")
                v = torch.randn_like(k)
                mask = (torch.arange(window, device="cuda") < window - 3)[None, None, None].expand(1, 1, groups * t, window)
                table = torch.randperm(pool_blocks, device="cuda")[:window // block]
                gathered = torch.empty(window // block, block, kv_heads, d, dtype=torch.bfloat16, device="cuda")
                gather = graph_time(lambda: torch.index_select(pool, 0, table, out=gathered))
                cells = [t, window, f"{gather * 1e6:.1f}"]
                for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    try:
                        with sdpa_kernel([backend]):
                            seconds = graph_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                        cells.append(f"{seconds * 1e6:.1f}")
                    except Exception as error:  # noqa: BLE001: a backend that does not take these inputs
                        cells.append(f"n/a ({type(error).__name__})")
                seconds = graph_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                cells.append(f"{seconds * 1e6:.1f}")
                rows.append(cells)
        return ("One layer; x 2 gathers (keys, values) and x 32 layers per step.\n\n" +
                report.table(rows, ["rows", "window (keys)", "gather keys (µs)", "SDPA math", "SDPA efficient",
                                    "SDPA cuDNN", "SDPA default (µs)"]))

    with torch.no_grad():
        section("Steps", steps, out)
        section("Kernels in the captured step", kernels, out)
        section("Matrix products alone", gemm, out)
        section("Decode attention alone", attention, out)
    text = "\n\n".join(out)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
