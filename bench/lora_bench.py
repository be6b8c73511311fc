"""What serving LoRA adapters costs a forward, in process (`python -m bench.lora_bench`): the target's step
(1 row) and verify (K + 1 rows), for one sequence and for --batch, with

  no adapters       the executor built without any (what every server without --lora-modules runs)
  base rows         --adapters loaded, every sequence on the base model
  one adapter       every sequence on adapter 1
  mixed             the sequences spread over the base model and every adapter, one forward

Adapters are drawn at rank --rank over every projection (their values do not change a forward's cost). The
settings take turns (--turns), each figure the median of its turns: this machine's speed drifts.
Eagerly (CPU, compile off) a forward groups its rows by adapter; with CUDA graphs every adapter's product
runs for every row (engine/lora.py): there the cost grows with the adapters served.

    python -m bench.lora_bench                         # CPU: the default pair's target
    python -m bench.lora_bench --pair 8b --adapters 4  # GPU: the 8B-shaped target, CUDA graphs
    python -m bench.lora_bench --served                # the default pair served, with and without an adapter
    python -m bench.lora_bench --runtime               # the default pair served: load_lora_adapter's answer time
    python -m bench.lora_bench --draft-lora            # a layer-skip self-draft with a request's adapter, or without

--served starts the default pair with one adapter of rank --rank whose products are small (its text stays
near the base model's, so the drafts' acceptance is comparable: what is measured is the adapter's cost), and
sends loadtest/prompts.jsonl's prompts greedy, --max-tokens each, target-only and with the server's default
draft, with the adapter and without, taking turns: tokens/s, tokens per round and the texts' agreement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import gpu_bench, report
from specdec.engine import lora
from specdec.engine.build import static_executor
from specdec.engine.executor import Step
from specdec.engine.loading import load_causal_lm
from specdec.serving import pairs
from specdec.serving import server as serving

REPO = Path(__file__).resolve().parents[1]


def _prepare(lm, names: list[str], vocab: int, context: int, k: int) -> dict:
    """Each timed call of one setting: (rows, sequences) -> its steps, after prompts of `context` tokens."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in names]
    for seq, (prompt, name) in enumerate(zip(prompts, names), 1):
        lm.extend_many([Step(seq, 0, prompt, 1, adapter=name)])
    return {(width, count): [Step(seq, context, prompts[seq - 1][:width], width) for seq in range(1, count + 1)]
            for width in (1, k + 1) for count in sorted({1, len(names)})}


def served(args) -> str:
    """The default pair served with one near-zero adapter: each setting with and without it, taking turns."""
    import json

    from client import Client, GenerationParams

    work = Path(tempfile.mkdtemp(prefix="lora-bench-served-"))
    model = load_causal_lm(str(pairs.default_pair().target_path), "cpu", "float32")
    lora.save_adapter(work / "near", lora.random_adapter(model, rank=args.rank, seed=0, std=0.005), rank=args.rank,
                      alpha=args.rank)
    del model
    rows = [json.loads(line) for line in (REPO / "loadtest" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows]
    srv = serving.start(work / "run", work / "server.log", ["--pair", "default", "--lora-modules", f"near={work / 'near'}"])
    results: dict = {}
    try:
        client = Client(srv.grpc_url)
        settings = [(draft, adapter) for draft in ("target-only", "default draft") for adapter in ("base model", "adapter")]
        for turn in range(args.turns):
            for draft, adapter in settings if turn % 2 == 0 else settings[::-1]:
                params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0,
                                          num_draft_tokens=0 if draft == "target-only" else None,
                                          lora_name="near" if adapter == "adapter" else None)
                for prompt in prompts:
                    result = client.generate(prompt, params, stream=True)
                    results.setdefault((draft, adapter), []).append(result)
    finally:
        srv.stop()
    table = []
    for draft in ("target-only", "default draft"):
        base = None
        for adapter in ("base model", "adapter"):
            done = results[(draft, adapter)]
            seconds = sum(r.latency_s for r in done)
            tokens = sum(r.num_output_tokens for r in done)
            rate = tokens / seconds
            base = base or rate
            same = sum(a.text == b.text for a, b in zip(done, results[(draft, "base model")]))
            table.append([draft, adapter, f"{rate:.1f}", f"{rate / base:.2f}x",
                          f"{tokens / max(1, sum(r.num_rounds for r in done)):.2f}", f"{same}/{len(done)}"])
    header = (f"{report.machine()}, the default pair served (its default draft: prompt lookup first, else its "
              f"EAGLE-3 head), one adapter of rank {args.rank} over every projection near the base model, "
              f"{len(prompts)} prompts x {args.turns} turns, {args.max_tokens} tokens each, greedy, streamed")
    return report.print_table(header, table, ["draft", "rows' model", "tokens/s", "over the base model's",
                                              "tokens per round", "text = the base model's"], args.out)


def draft_lora(args) -> str:
    """A layer-skip self-draft of the default pair's target (--skip-layers left out: SWIFT's draft) drafting
    for an adapter's requests with the adapter (--skip-draft-lora: lora_layers first) and without (the
    default): two servers, one after the other, the same adapter (one that changes the text),
    prompts and settings."""
    import json

    from client import Client, GenerationParams

    work = Path(tempfile.mkdtemp(prefix="lora-bench-draft-"))
    model = load_causal_lm(str(pairs.default_pair().target_path), "cpu", "float32")
    lora.save_adapter(work / "tuned", lora.random_adapter(model, rank=args.rank, seed=0, std=args.std), rank=args.rank,
                      alpha=args.rank)
    del model
    rows = [json.loads(line) for line in (REPO / "loadtest" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows]
    skip = ["--skip-draft", f"draft_skip={args.skip_layers}"]
    modes = {"with the adapter": [*skip, "--skip-draft-lora"], "base model": skip}
    settings = [(k, adapter) for k in (4, None) for adapter in ("adapter", "base model")]
    results: dict = {}
    for mode, extra in modes.items():
        srv = serving.start(work / "run", work / f"server-{len(results)}.log",
                            ["--pair", "default", "--lora-modules", f"tuned={work / 'tuned'}", *extra])
        try:
            client = Client(srv.grpc_url)
            for turn in range(args.turns):
                for k, adapter in settings if turn % 2 == 0 else settings[::-1]:
                    params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0,
                                              num_draft_tokens=k or 8, adaptive_draft=k is None,
                                              draft_model="draft_skip",
                                              lora_name="tuned" if adapter == "adapter" else None)
                    for prompt in prompts:
                        results.setdefault((mode, k, adapter), []).append(client.generate(prompt, params, stream=True))
        finally:
            srv.stop()
    table = []
    for k, adapter in settings:
        for mode in modes:
            done = results[(mode, k, adapter)]
            tokens = sum(r.num_output_tokens for r in done)
            drafted = sum(r.total_draft_tokens for r in done)
            table.append([adapter, "K=4" if k else "adaptive K<=8", mode if adapter == "adapter" else "(no adapter)",
                          f"{tokens / sum(r.latency_s for r in done):.1f}",
                          f"{sum(r.total_accepted_draft_tokens for r in done) / max(1, drafted):.3f}",
                          f"{tokens / max(1, sum(r.num_rounds for r in done)):.2f}"])
    same = sum(a.text == b.text for a, b in zip(results[("with the adapter", 4, "adapter")],
                                                results[("with the adapter", 4, "base model")]))
    header = (f"{report.machine()}, the default pair served, a layer-skip self-draft (its target without layers "
              f"{args.skip_layers}) for every request, one adapter of rank {args.rank} over every "
              f"projection (drawn at std {args.std}: {len(prompts) * args.turns - same} of "
              f"{len(prompts) * args.turns} answers differ from the base model's), {len(prompts)} prompts x "
              f"{args.turns} turns, {args.max_tokens} tokens each, greedy, streamed")
    return report.print_table(header, table, ["requests' model", "draft length", "the draft drafts with",
                                              "tokens/s", "acceptance", "tokens per round"], args.out)


def on_demand(model, args, device: str, dtype: str, pair: str, reps: int) -> str:
    """Adapters read from a directory (lora_directory): what one read takes, what a held one's lookup takes,
    a slot's memory, and a decode step of rows of two adapters with max_loras slots of 2 and of 6."""
    directory = Path(tempfile.mkdtemp(prefix="lora-library-"))
    for i in range(reps + 2):
        weights = {key: (a.to(model.dtype), b.to(model.dtype)) for key, (a, b) in
                   lora.random_adapter(model, rank=args.rank, seed=i, std=0.01).items()}
        lora.save_adapter(directory / f"a{i}", weights, rank=args.rank, alpha=args.rank)
    file_mib = sum(f.stat().st_size for f in (directory / "a0").iterdir()) / 2**20
    lm = static_executor(model, max_sequences=args.batch + 1, max_context=args.context + 64, max_batch=args.batch,
                         max_rows=args.k + 1, lora_directory=str(directory), max_loras=1, max_lora_rank=args.rank)
    reads, lookups = [], []
    for i in range(2, reps + 2):  # a0 and a1 are the step's; each of the others read into the one slot
        started = time.perf_counter()
        lm.adapters.acquire(f"a{i}", set())
        reads.append(time.perf_counter() - started)
        for _ in range(5):  # (a held directory adapter's entry is checked for a change: a few stats)
            started = time.perf_counter()
            lm.adapters.acquire(f"a{i}", set())
            lookups.append(time.perf_counter() - started)
    rows = [["read an adapter into a slot (ms)", f"{statistics.median(reads) * 1e3:.1f}"],
            ["look up a held one (ms)", f"{statistics.median(lookups) * 1e3:.3f}"],
            ["its file (MiB)", f"{file_mib:.1f}"], ["a slot's tensors (MiB)", f"{lm.adapters.bytes / 2**20:.1f}"]]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (args.context,), generator=gen).tolist()
               for _ in range(args.batch)]
    for slots in (2, 6):
        lm = static_executor(model, max_sequences=args.batch + 1, max_context=args.context + 64, max_batch=args.batch,
                             max_rows=args.k + 1, lora_directory=str(directory), max_loras=slots,
                             max_lora_rank=args.rank)
        for seq, prompt in enumerate(prompts, 1):
            lm.extend_many([Step(seq, 0, prompt, 1, adapter=f"a{seq % 2}")])
        steps = [Step(seq, args.context, prompt[:1], 1) for seq, prompt in enumerate(prompts, 1)]
        times = [gpu_bench.timed(lambda: lm.extend_many(steps), device, reps) for _ in range(args.turns)]
        rows.append([f"decode step, {args.batch} rows of 2 adapters, max_loras {slots} (ms)",
                     f"{statistics.median(times) * 1e3:.2f}"])
    header = (f"{report.machine()}, {pair} pair's target, {dtype}, adapters of rank "
              f"{args.rank} (every projection) read on demand")
    return report.print_table(header, rows, ["what", "value"], args.out)


def runtime(args) -> str:
    """The default pair served with --allow-runtime-lora-updating: what POST /v1/load_lora_adapter takes (a
    link, the target's read, one token generated with it) and /v1/unload_lora_adapter, against a one-token
    completion of the base model (what a load adds to it is the read), each adapter new (--reps of them)."""
    import requests

    work = Path(tempfile.mkdtemp(prefix="lora-bench-runtime-"))
    model = load_causal_lm(str(pairs.default_pair().target_path), "cpu", "float32")
    reps = args.reps or 5
    for i in range(reps):
        lora.save_adapter(work / "uploads" / f"a{i}", lora.random_adapter(model, rank=args.rank, seed=i, std=0.005),
                          rank=args.rank, alpha=args.rank)
    del model
    (work / "library").mkdir()
    srv = serving.start(work / "run", work / "server.log", ["--pair", "default", "--lora-directory",
                                                             str(work / "library"), "--allow-runtime-lora-updating"])
    timings: dict[str, list[float]] = {}

    def timed(what: str, endpoint: str, body: dict) -> None:
        started = time.perf_counter()
        answer = session.post(f"{srv.openai_url}/{endpoint}", json=body, timeout=300)
        timings.setdefault(what, []).append(time.perf_counter() - started)
        answer.raise_for_status()

    try:
        session = requests.Session()
        model_name = session.get(f"{srv.openai_url}/models", timeout=30).json()["data"][0]["id"]
        one_token = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        for i in range(reps):
            timed("completion, 1 token, the base model", "completions", {"model": model_name, **one_token})
            timed("load_lora_adapter (a new adapter)", "load_lora_adapter",
                  {"lora_name": f"a{i}", "lora_path": str(work / "uploads" / f"a{i}")})
            timed("completion, 1 token, the adapter loaded", "completions", {"model": f"a{i}", **one_token})
            timed("unload_lora_adapter", "unload_lora_adapter", {"lora_name": f"a{i}"})
    finally:
        srv.stop()
    rows = [[what, f"{statistics.median(values) * 1e3:.1f}", f"{min(values) * 1e3:.1f}", f"{max(values) * 1e3:.1f}"]
            for what, values in timings.items()]
    header = (f"{report.machine()}, the default pair served (float32), {reps} adapters of rank {args.rank} over every "
              f"projection loaded, used and unloaded in turn through the OpenAI API")
    return report.print_table(header, rows, ["call", "median (ms)", "min (ms)", "max (ms)"], args.out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("default", "tiny", "8b"), default=None, help="default: 8b on a GPU")
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=None, help="calls per timing (their median)")
    parser.add_argument("--turns", type=int, default=5, help="timings per setting, the settings taking turns")
    parser.add_argument("--served", action="store_true", help="the default pair served, with and without an adapter")
    parser.add_argument("--max-tokens", type=int, default=64, help="--served: tokens per request")
    parser.add_argument("--on-demand", action="store_true",
                        help="adapters read from a directory: a read, a lookup, a slot, steps over more slots")
    parser.add_argument("--runtime", action="store_true",
                        help="the default pair served: load_lora_adapter and unload_lora_adapter's answer times")
    parser.add_argument("--draft-lora", action="store_true",
                        help="the default pair's layer-skip draft drafting with a request's adapter, and without")
    parser.add_argument("--std", type=float, default=0.02, help="--draft-lora: the adapter's weights' spread")
    parser.add_argument("--skip-layers", default="7,9,11,13,15,17,19,21",
                        help="--draft-lora: the layers the self-draft leaves out (the search's first set)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)
    if args.runtime:
        runtime(args)
        return 0
    if args.draft_lora:
        text = draft_lora(args)
        if args.results:
            report.write_results(args.results, "LoRA adapters: the draft drafting with them", text)
        return 0
    if args.served:
        text = served(args)
        if args.results:
            report.write_results(args.results, "LoRA adapters served: with and without one", text)
        return 0
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if gpu else ("cpu", "float32")
    pair = args.pair or ("8b" if gpu else "default")
    reps = args.reps or (20 if gpu else 5)
    if pair == "8b":
        root = pairs.cache_dir() / "pairs" / f"bench-8b-{dtype}-0.00015"
        target_path, _ = gpu_bench.build_pair(root, gpu_bench.SHAPES["8b"], getattr(torch, dtype), device, 1.5e-4)
    else:
        target_path = (pairs.tiny_pair() if pair == "tiny" else pairs.default_pair()).target_path
    if pair == "tiny":
        dtype = "float64"
    model = load_causal_lm(str(target_path), device, dtype)
    if args.on_demand:
        text = on_demand(model, args, device, dtype, pair, reps)
        if args.results:
            report.write_results(args.results, "LoRA adapters read on demand", text)
        return 0
    directory = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = {}
    for i in range(args.adapters):
        weights = {key: (a.to(model.dtype), b.to(model.dtype)) for key, (a, b) in
                   lora.random_adapter(model, rank=args.rank, seed=i, std=0.01).items()}
        lora.save_adapter(directory / f"a{i}", weights, rank=args.rank, alpha=args.rank)
        paths[f"a{i}"] = str(directory / f"a{i}")
    batch = args.batch
    names = [""] + list(paths)  # each row's adapter by name ("": the base model)
    settings = [("no adapters", {}, [""] * batch), ("base rows", paths, [""] * batch),
                ("one adapter", paths, [names[1]] * batch),
                ("mixed", paths, [names[i % len(names)] for i in range(batch)])]
    executors = []
    for setting, adapters, rows_names in settings:  # built first, then timed in turns: this machine's speed drifts
        lm = static_executor(model, max_sequences=batch + 1, max_context=args.context + 64, max_batch=batch,
                             max_rows=args.k + 1, lora_adapters=adapters)
        lm.warm_up(time_budget_s=240)
        executors.append((setting, lm, _prepare(lm, rows_names, model.config.vocab_size, args.context, args.k)))
    times: dict = {}
    for _ in range(args.turns):
        for name, lm, calls in executors:
            for key, steps in calls.items():
                times.setdefault((name, key), []).append(
                    gpu_bench.timed(lambda: lm.extend_many(steps), device, reps))
    keys = sorted(executors[0][2])
    median = {key: statistics.median(value) for key, value in times.items()}
    rows = []
    for name, lm, _ in executors:
        rows.append([name, f"{lm.adapters.bytes / 2**20:.1f}" if lm.adapters else "0"]
                    + [f"{median[(name, key)] * 1e3:.2f} ({median[(name, key)] / median[(settings[0][0], key)]:.2f}x)"
                       for key in keys])
    header = (f"{report.machine()}, torch {torch.__version__}, {pair} pair's target, {dtype}, {args.adapters} adapters "
              f"of rank {args.rank} (every projection), context {args.context}, K={args.k}")
    columns = ["rows' adapters", "adapters (MiB)"] + [f"{w} row{'s' * (w > 1)}, {c} seq{'s' * (c > 1)} (ms)"
                                                      for w, c in keys]
    text = report.print_table(header, rows, columns, args.out)
    if args.results:
        report.write_results(args.results, "LoRA adapters: what a forward costs with them, in process", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
