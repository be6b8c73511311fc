"""In-process step times of the executors (`make bench-executor`): what one forward costs, no server.

For a pair (the GPU bench's synthetic 8B-shaped one on a GPU, the tiny or default pair on CPU) it times,
after a prompt of --context tokens: a target step of 1 token and a verify of K+1, for 1 and --batch
sequences, the same K+1 rows verified as a tree 3 wide (one sequence), and the draft proposing K tokens, with

  dynamic      `dynamic_executor`: transformers' forward, per-sequence growing buffers (the CPU default)
  static/off   `static_executor` eagerly: paged pool, bucketed shapes, no capture
  static/graphs     the same, each bucket captured as a CUDA graph, pointwise work in fused kernels (GPU)
  static/graphs-unfused   CUDA graphs over the eager pointwise kernels
  static/graphs-mlp       the graphs with each SiLU MLP's gate/up products fused too (`fuse_mlp`)
  static/<mode>-sdpa      any of these with attention over a gathered window by SDPA instead of the paged
                          kernel that CUDA devices take by default (`attention`, engine/paged_attention.py)
  reference    plain PyTorch with transformers' static cache + torch.compile (GPU only)

and how long capturing took. The target's logits in every mode are compared with the dynamic one's.

    python -m bench.executor_bench --pair tiny                 # CPU
    python -m bench.executor_bench --pair default --linear-kernels torch,onednn,panels   # CPU linear kernels
    python -m bench.executor_bench --reference                 # GPU: the 8B-shaped pair
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from bench import gpu_bench, report
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import Step
from specdec.engine.loading import load_causal_lm
from specdec.serving import pairs

HERE = Path(__file__).resolve().parent


def make(model, mode: str, batch: int, k: int, context: int):
    if mode == "dynamic":
        return dynamic_executor(model), 0.0
    started = time.perf_counter()
    # "graphs-unfused": CUDA graphs over the eager pointwise kernels (what fuse_kernels saves);
    # "graphs-mlp": the MLP's gate/up products fused as well (what fuse_mlp saves); "-sdpa": the gathered
    # window and SDPA (what the paged attention kernel saves)
    attention = "sdpa" if mode.endswith("-sdpa") else "auto"
    mode = mode.removesuffix("-sdpa")
    # Fused pointwise kernels where CUDA graphs run, as served (`off` is the eager static executor a CPU
    # server runs: compiling them there would time a configuration no server uses)
    lm = static_executor(model, max_sequences=batch + 1, max_context=context + 64, max_batch=batch,
                        max_rows=k + 1, compile=mode.removesuffix("-unfused").removesuffix("-mlp"),
                        fuse_kernels=False if mode == "graphs-unfused" else None, fuse_mlp=mode.endswith("-mlp"),
                        attention=attention)
    lm.warm_up(time_budget_s=240)
    return lm, time.perf_counter() - started  # compiling the fused kernels and capturing


def time_lm(lm, vocab: int, context: int, batch: int, k: int, reps: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
    for seq, prompt in enumerate(prompts, 1):
        lm.extend(seq, 0, prompt, 1)
    out = {}
    for width in (1, k + 1):
        for b in (1, batch):
            steps = [Step(seq, context, prompts[seq - 1][:width], width) for seq in range(1, b + 1)]
            out[(width, b)] = gpu_bench.timed(lambda: lm.extend_many(steps), device, reps)
    # The same K+1 rows as a token tree (each node after its parent, as many children a node as the default
    # pair's trees are wide, breadth first): what a tree's mask and per-node positions add to a chain's verify
    width = pairs.DEFAULT_PAIR_DRAFT_BRANCHES
    tree = tuple([-1] + [(node - 1) // width for node in range(1, k + 1)])
    tree_step = [Step(1, context, prompts[0][:k + 1], k + 1, tree=tree)]
    (result,) = lm.extend_many(tree_step)
    # an executor that refuses this tree (larger than its tree buckets) is not timed on its refusal
    out["tree"] = None if isinstance(result, Exception) else gpu_bench.timed(lambda: lm.extend_many(tree_step),
                                                                             device, reps)
    out["logits"] = lm.extend(1, context, prompts[0][:k + 1], k + 1).float().cpu()
    out["propose"] = gpu_bench.timed(lambda: lm.propose(1, context, prompts[0][:1], k, SamplingParams()), device, reps)
    for seq in range(1, batch + 1):
        lm.release(seq)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("8b", "tiny", "default"), default=None,
                        help="default: 8b on a GPU, tiny on CPU")
    parser.add_argument("--modes", default=None, help="static executor modes, comma-separated "
                        "(default: off,graphs on a GPU, off on CPU)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--reference", action="store_true", help="also time the compiled static-cache reference")
    parser.add_argument("--linear-kernels", default="auto",
                        help="the models' linear_kernels, comma-separated: one set of rows each (CPU)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    pair = args.pair or ("8b" if gpu else "tiny")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    modes = ["dynamic"] + (args.modes or ("off,graphs" if gpu else "off")).split(",")
    reps = args.reps or (20 if gpu else 10)
    if pair == "8b":
        root = pairs.cache_dir() / "pairs" / f"bench-8b-{dtype}-0.00015"
        target_path, draft_path = gpu_bench.build_pair(root, gpu_bench.SHAPES["8b"], getattr(torch, dtype), device,
                                                       1.5e-4)
    else:
        spec = pairs.tiny_pair() if pair == "tiny" else pairs.default_pair()
        target_path, draft_path = spec.target_path, next(iter(spec.draft_paths.values()))
    rows, reference_logits = [], None
    kernel_kinds = args.linear_kernels.split(",")
    for role, path, kernels in [(role, path, kernels) for role, path in (("target", target_path), ("draft", draft_path))
                                for kernels in kernel_kinds]:
        model = load_causal_lm(str(path), device, dtype, linear_kernels=kernels)
        kernels = model.linear_kernel_choice.name
        if args.reference and role == "target" and gpu:
            widths = [1, args.k + 1]
            ref = gpu_bench.reference_steps(model, device, args.context, widths, "reduce-overhead", reps)
            rows.append([role, "reference (static cache, compiled)", kernels, f"{ref[1] * 1e3:.2f}", "",
                         f"{ref[args.k + 1] * 1e3:.2f}", "", "", "", "", ""])
            gpu_bench.log(" | ".join(rows[-1]))
        for mode in modes:
            gpu_bench.log(f"{role} {mode}")
            lm, setup_s = make(model, mode, args.batch, args.k, args.context)
            t = time_lm(lm, model.config.vocab_size, args.context, args.batch, args.k, reps, device)
            if role == "target":
                if reference_logits is None:  # the first target row's (dynamic, the first kernels')
                    reference_logits = t["logits"]
                diff = (t["logits"] - reference_logits).abs().max().item()
            else:
                diff = float("nan")
            rows.append([role, mode, kernels] + [f"{t[(w, b)] * 1e3:.2f}" for w in (1, args.k + 1) for b in (1, args.batch)]
                        + ["refused" if t["tree"] is None else f"{t['tree'] * 1e3:.2f}", f"{t['propose'] * 1e3:.2f}",
                           f"{setup_s:.1f}", f"{diff:.2g}"])
            gpu_bench.log(" | ".join(rows[-1]))  # as it comes: a run cut short still shows its rows
            del lm
            if gpu:
                torch.cuda.empty_cache()
        del model
    machine = torch.cuda.get_device_name() if gpu else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    header = f"{machine}, torch {torch.__version__}, {pair} pair, {dtype}, context {args.context}, K={args.k}"
    text = report.print_table(header, rows, ["model", "executor", "linear kernels", "1 row, 1 seq (ms)", f"1 row, {args.batch} seqs",
                                         f"{args.k + 1} rows, 1 seq", f"{args.k + 1} rows, {args.batch} seqs",
                                         f"tree of {args.k + 1}, 1 seq", f"propose {args.k} (ms)",
                                         "compile + capture (s)", "max |Δ logits|"], args.out)
    if args.results:
        report.write_results(args.results, "The executors' forward costs in process: `make bench-executor`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
