"""Where a served round's time goes (`make bench-overhead`): the serving machinery around the models.

Serves the tiny pair (two layers, but a float64 head over SmolLM2's whole vocabulary: on CPU its forwards
are not free, so they are split out), or `--pair default` (SmolLM2-135M as `make serve` serves it), or
with --pair 8b `make bench-gpu`'s synthetic 8B-shaped bf16 pair (GPU only; `--pair small`: its tiny-shaped
twin, float32 on CPU), runs greedy (or, with --temperature, seeded sampled) requests of fixed length at
K=0 (target-only) and K fixed, one at a time, and splits each round's wall time with the server's own
counters (deltas over the measured requests, per round):

  target_model / draft_model forward   specdec_model_forward_seconds_total: the executor's forward passes
  ... hosted heads' drafting           specdec_hosted_head_seconds_total: a head hosted in target_model
                                       drafting in the verify call, before its forward
  ... adapter                          Triton's compute_infer minus those: parsing inputs, building
                                       the outputs, metrics (the Python model's own work)
  ... Triton in/out + queue            compute_input + compute_output + queue: the backend moving tensors
                                       to and from the stub, the sequence batcher's wait
  orchestrator, BLS and client         the rest: the orchestrator's Python (decode loop, text, metrics),
                                       its BLS calls' IPC, the ensemble's pre/postprocessing, the client
  round minus the forwards             everything but the models' forward passes (and hosted heads'
                                       drafting): the serving machinery

and the CPU time each server process used per round (Linux): tritonserver and every model's stub; a
model's forwards count once per thread that ran them.

    python -m bench.round_overhead                 # CPU
    python -m bench.round_overhead --device gpu    # the same with the models on the GPU
    python -m bench.round_overhead --device gpu --pair 8b --launcher-arg=--max-num-draft-tokens=4
                                                   # the served 8B-shaped pair's rounds, split (verify
                                                   # buckets as `make bench-gpu` sets them)
    python -m bench.round_overhead --pair default --draft eagle3 --branches 1
                                                   # the default pair's trained head drafting chains: its
                                                   # model's calls split out like the draft model's
    python -m bench.round_overhead --pair default --draft eagle3 --paused-draft
                                                   # the K=0 rows name the head too: what a head's request pays
                                                   # a round while it drafts nothing (the target's features)
    python -m bench.round_overhead --whole         # one response per request instead of a streamed
                                                   # response per round (the default, what a streaming
                                                   # Triton or OpenAI client sees): what streaming costs
    python -m bench.round_overhead --regex '[a-z ]{64,}'   # structured output: guided rounds
    python -m bench.round_overhead --temperature 1 --top-p 0.9          # sampled rounds with a nucleus
    python -m bench.round_overhead --device gpu --temperature 1 \
        --launcher-arg=--set=target_model.device_outputs=false --launcher-arg=--set=draft_model.device_outputs=false
                                                   # sampled rounds, logits through host memory (the default
                                                   # hands them over on the device)
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from pathlib import Path

from client import Client, GenerationParams
from bench.gpu_bench import synthetic_pair
from bench.report import print_table
from specdec.serving import pairs, server
from specdec.serving.metrics_text import samples, sum_samples

HERE = Path(__file__).resolve().parent

MODELS = ("target_model", "draft_model")  # always split out; a served head (e.g. `eagle3`) joins them when it ran
TRITON = {"queue": "nv_inference_queue_duration_us", "input": "nv_inference_compute_input_duration_us",
          "infer": "nv_inference_compute_infer_duration_us", "output": "nv_inference_compute_output_duration_us",
          "calls": "nv_inference_request_success"}


def server_cpu(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the launcher's descendants by role: tritonserver, and each
    Python model's stubs by model name, a model's instances summed (Linux /proc; {} elsewhere). Per
    round these say which process the serving machinery's time goes to, steadier than wall time on a
    shared machine."""
    proc, tick = Path("/proc"), os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents, stats, names = {}, {}, {}
    for entry in proc.glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid], stats[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        match = re.search(r"/([^/ ]+)/1/model\.py", command)
        names[pid] = match.group(1) if match else "tritonserver" if "tritonserver" in command.split(" ")[0] else None
    out: dict[str, float] = {}
    for pid, name in names.items():
        ancestor = parents.get(pid)
        while ancestor and ancestor != root_pid:
            ancestor = parents.get(ancestor)
        if name and ancestor == root_pid:
            out[name] = out.get(name, 0.0) + stats[pid]
    return out


def forward_models(text: str) -> tuple[str, ...]:
    """MODELS, then every other model whose executor reports forwards (the draft heads a pair serves)."""
    named = {labels.get("model") for labels, _ in samples(text, "specdec_model_forward_seconds_total")}
    return MODELS + tuple(sorted(name for name in named if name and name not in MODELS))


def counters(text: str) -> dict:
    out = {"rounds": sum_samples(text, "specdec_rounds_total")}
    for model in forward_models(text):
        out[model, "forward"] = sum_samples(text, "specdec_model_forward_seconds_total", model=model)
        out[model, "hosted"] = sum_samples(text, "specdec_hosted_head_seconds_total", model=model)  # every head's
        for key, name in TRITON.items():
            out[model, key] = sum_samples(text, name, model=model)
    return out


def measure(own, params: GenerationParams, prompts: list[str], repeats: int, stream: bool = False) -> dict:
    client = Client(own.grpc_url, "grpc", timeout_s=600)
    for prompt in prompts[:2]:  # warm this path
        client.generate(prompt, params, stream=stream)
    time.sleep(1.0)  # the model metrics are flushed at most twice a second
    before, wall, cpu_before = counters(own.metrics()), 0.0, server_cpu(own.process.pid)
    for _ in range(repeats):
        for prompt in prompts:
            started = time.perf_counter()
            client.generate(prompt, params, stream=stream)
            wall += time.perf_counter() - started
    cpu_after = server_cpu(own.process.pid)
    time.sleep(1.0)
    after = counters(own.metrics())
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    rounds = delta["rounds"]
    out = {"round": wall / rounds * 1e3, "rounds": rounds}
    out["models"], models = {}, 0.0
    for model in dict.fromkeys(key[0] for key in delta if isinstance(key, tuple)):  # counters' models, in order
        forward = delta[model, "forward"] * 1e3 / rounds
        hosted = delta[model, "hosted"] * 1e3 / rounds
        infer = delta[model, "infer"] / 1e3 / rounds
        edges = (delta[model, "queue"] + delta[model, "input"] + delta[model, "output"]) / 1e3 / rounds
        out["models"][model] = {"forward": forward, "hosted": hosted, "adapter": max(infer - forward - hosted, 0.0),
                                "triton": edges, "calls": delta[model, "calls"] / rounds}
        models += infer + edges
    out["rest"] = out["round"] - models
    out["cpu"] = {name: (cpu_after[name] - cpu_before.get(name, 0.0)) * 1e3 / rounds for name in cpu_after
                  if cpu_after[name] > cpu_before.get(name, 0.0)}
    return out


PAIRS = ("tiny", "default", "8b", "small")


def served_pair(name: str, device: str) -> tuple[str, list[str]]:
    """(the table's label, the launcher's pair arguments) for a --pair name: the tiny test pair, or
    gpu_bench's synthetic pair (built once, in bfloat16 on the GPU and float32 on CPU)."""
    if name == "tiny":
        pair = pairs.tiny_pair()
        return "tiny pair", ["--target", pair.target_path, "--draft", pair.draft_paths["draft_model"],
                             "--tokenizer", pair.tokenizer_path]
    if name == "default":  # SmolLM2-135M served as `make serve` serves it (its head's model split out too)
        return "default pair", ["--pair", "default"]
    if name == "8b" and device != "gpu":
        raise ValueError("--pair 8b needs --device gpu (a 16 GB bfloat16 model; --pair small is its CPU twin)")
    dtype = "bfloat16" if device == "gpu" else "float32"
    target, draft = synthetic_pair(name == "small", dtype, "cuda" if device == "gpu" else "cpu")
    label = "synthetic 8B-shaped pair" if name == "8b" else "synthetic small pair"
    return f"{label} ({dtype})", ["--target", str(target), "--draft", str(draft), "--dtype", dtype]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--pair", choices=PAIRS, default="tiny")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled rounds (seeded)")
    parser.add_argument("--top-p", type=float, help="sampled rounds' top_p (with --temperature)")
    parser.add_argument("--whole", dest="stream", action="store_false",
                        help="one response per request (default: streamed, a response per round, as clients ask)")
    parser.add_argument("--draft", help="the requests' draft_model (e.g. `eagle3`, the default pair's head); "
                        "default: the server's default draft")
    parser.add_argument("--branches", type=int, help="the requests' num_draft_branches (1: chains)")
    parser.add_argument("--paused-draft", action="store_true",
                        help="the K=0 rows' requests name --draft too, drafting nothing: what holding that draft "
                             "costs a round (a trained head's requests take the target's features every round)")
    parser.add_argument("--regex", help="structured output: every request follows this regex guide")
    parser.add_argument("--launcher-arg", action="append", default=[], help="more launcher arguments")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    try:
        label, pair_args = served_pair(args.pair, args.device)
    except ValueError as exc:
        parser.error(str(exc))
    if args.top_p is not None and not args.temperature:
        parser.error("--top-p applies to sampled rounds: give --temperature too")
    if args.paused_draft and not args.draft:
        parser.error("--paused-draft names --draft in the K=0 rows: give --draft too")
    launcher_args = [*pair_args, "--device", args.device, *args.launcher_arg]
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    cache = pairs.cache_dir()
    own = server.start(cache / "run" / "bench-overhead", cache / "bench-overhead-server.log", launcher_args)
    try:
        results = {}
        for name, k in (("K=0", 0), (f"K={args.k}", args.k)):
            params = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=k, adaptive_draft=False,
                                      ignore_eos=True, temperature=args.temperature, top_p=args.top_p,
                                      seed=1 if args.temperature else None,
                                      guide_type="regex" if args.regex else None, guide=args.regex,
                                      draft_model=args.draft if k or args.paused_draft else None,
                                      num_draft_branches=args.branches if k else None)
            results[name] = measure(own, params, prompts, args.repeats, args.stream)
    finally:
        own.stop()
    rows = []
    for name, r in results.items():
        rows.append([name, "round (client wall time / rounds)", f"{r['round']:.2f}", f"{r['rounds']:.0f} rounds"])
        for model, m in r["models"].items():
            if not m["calls"]:
                continue
            rows.append([name, f"{model} forward", f"{m['forward']:.2f}", f"{m['calls']:.2f} calls per round"])
            if m["hosted"]:
                rows.append([name, f"{model} hosted heads' drafting", f"{m['hosted']:.2f}", "in the verify call"])
            rows.append([name, f"{model} adapter", f"{m['adapter']:.2f}", ""])
            rows.append([name, f"{model} Triton in/out + queue", f"{m['triton']:.2f}", ""])
        rows.append([name, "orchestrator, BLS, ensemble and client", f"{r['rest']:.2f}", ""])
        forwards = sum(m["forward"] + m["hosted"] for m in r["models"].values())
        rows.append([name, "round minus the forwards: the serving machinery", f"{r['round'] - forwards:.2f}",
                     "adapters, Triton in/out, orchestrator, BLS, ensemble, client"])
        for process, ms in sorted(r["cpu"].items(), key=lambda item: -item[1]):
            rows.append([name, f"CPU time: {process}", f"{ms:.2f}", "user + system, all its threads"])
    mode = f"sampled (temperature {args.temperature:g}{'' if args.top_p is None else f', top_p {args.top_p:g}'})" \
        if args.temperature else "greedy"
    mode += ", streamed" if args.stream else ", whole responses"
    mode += f", guided by the regex {args.regex!r}" if args.regex else ""
    extra = f", {' '.join(args.launcher_arg)}" if args.launcher_arg else ""
    extra += f", draft {args.draft}" + (" (K=0 too)" if args.paused_draft else "") if args.draft else ""
    extra += f", {args.branches} branches at most" if args.branches else ""
    header = (f"{platform.machine()} {args.device}, {label}, {mode}, {args.max_tokens} tokens per request, "
              f"one request at a time{extra}")
    print_table(header, rows, ["", "where", "ms per round", ""], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
