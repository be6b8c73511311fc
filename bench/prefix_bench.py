"""Prefix caching, served: requests that share a long system prompt, against the same requests made
unshareable, side by side on one server (`make bench-prefix`).

  shared   every request is the same system prompt (about --system-words words) and a question of its own
  unique   the same, with a tag unique to the request at the system prompt's start: no block of it is
           found again, so both models run the whole prompt (what every request costs without the cache)

Both carry a tag of the same length ("Ticket 100000." for shared, a new number for unique), so their prompts
have the same number of tokens. Requests go one at a time, streamed over gRPC, alternating between the
two kinds, `--requests` of each after one warm-up of each; it prints TTFT (request sent -> first text),
latency and output tokens/s (median, p90), and from the models' own metrics, per request, the prompt
tokens looked up and found in the prefix cache and the tokens each model ran.

With --stall, what long prompts cost other requests (chunked prefill): --streams plain streamed requests
(short prompts, target-only) run for --seconds alone, then beside a client sending one long prompt after
another (unique: nothing cached), and it prints the gaps between the plain streams' responses (median,
p99, max) and the long requests' TTFT. Compare servers with `prefill_chunk_tokens` set differently.

    python -m bench.prefix_bench --pair default          # starts the default pair's server of its own
    python -m bench.prefix_bench --url localhost:8001 --metrics-url localhost:8002
    python -m bench.prefix_bench --pair default --stall --long-every 3 --launcher-arg=--set \
        --launcher-arg=speculative_decoding.prefill_chunk_tokens=512
    python -m bench.prefix_bench --pair gpu-8b --draft-model draft_model   # gpu_bench.py's 8B-shaped pair
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # beside, gpu_bench

from bench import beside

from client import Client, GenerationParams
from specdec.serving import server
from specdec.serving.metrics_text import scrape, sum_samples

HERE = Path(__file__).resolve().parent
MODELS = ("target_model", "draft_model")
# A shared system prompt: the load test's (locustfile.py --system-prompt-file), repeated to length.
SYSTEM = (HERE.parent / "loadtest" / "system_prompt.txt").read_text().strip()
QUESTIONS = ["Can I return a rope I bought last week?", "Are you open on Sunday morning?",
             "How long does a lawn mower repair take?", "Do you deliver to the next valley?",
             "Can you mix a paint colour from a photo?", "Can I get a security key copied today?"]


def system_prompt(words: int) -> str:
    """The system text repeated (as a long policy document would run on) to about `words` words."""
    base = SYSTEM.split()
    return " ".join(itertools.islice(itertools.cycle(base), words))


def counters(metrics_url: str | None) -> dict:
    if not metrics_url:
        return {}
    text = scrape(metrics_url)
    return {(name, model): sum_samples(text, f"specdec_model_{name}", model=model)
            for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "tokens_processed_total")
            for model in MODELS}


def pair_arguments(pair: str) -> list[str]:
    """Launcher arguments serving `pair`: a named pair, or gpu_bench.py's synthetic ones (gpu-8b: the
    8B-shaped bf16 pair on the GPU, built once; gpu-small: its tiny float32 version on CPU)."""
    if not pair.startswith("gpu-"):
        return ["--pair", pair]
    import gpu_bench

    small = pair == "gpu-small"
    dtype, device = ("float32", "cpu") if small else ("bfloat16", "cuda")
    target, draft = gpu_bench.synthetic_pair(small, dtype, device)
    return ["--target", str(target), "--draft", str(draft), "--device", "cpu" if small else "gpu", "--dtype", dtype]


def measure(url: str, metrics_url: str | None, args) -> tuple[dict, set[int]]:
    client = Client(url, timeout_s=600)
    system = system_prompt(args.system_words)
    params = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, ignore_eos=True,
                              draft_model=args.draft_model)
    kinds = ("shared", "unique")
    results = {kind: [] for kind in kinds}
    usage = {kind: {} for kind in kinds}
    prompt_tokens = set()
    tags = itertools.count(100001)
    for i in range(args.requests + 1):  # the first round of each kind warms up and is not counted
        for kind in kinds:
            tag = 100000 if kind == "shared" else next(tags)
            prompt = f"Ticket {tag}. {system}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"
            before = counters(metrics_url)
            result = client.generate(prompt, params, stream=True)
            after = counters(metrics_url)
            prompt_tokens.add(result.num_input_tokens)
            if i == 0:
                continue
            results[kind].append(result)
            for key in after:
                usage[kind][key] = usage[kind].get(key, 0.0) + after[key] - before[key]
        print(f"  round {i}: shared TTFT {results['shared'][-1].ttft_s * 1000 if i else 0:.0f} ms, "
              f"unique {results['unique'][-1].ttft_s * 1000 if i else 0:.0f} ms", file=sys.stderr, flush=True)
    rows = {}
    for kind in kinds:
        done = results[kind]
        ttft = [r.ttft_s * 1000 for r in done]
        latency = [r.latency_s * 1000 for r in done]
        rate = [r.num_output_tokens / r.latency_s for r in done]
        per = {key: value / len(done) for key, value in usage[kind].items()}
        rows[kind] = {"ttft": (statistics.median(ttft), beside.percentile(ttft, 0.9)),
                      "latency": (statistics.median(latency), beside.percentile(latency, 0.9)),
                      "rate": statistics.median(rate), "usage": per}
    return rows, prompt_tokens


def stall(url: str, args) -> list[str]:
    """Table rows: the plain streams' response gaps alone, then beside long unique prompts."""
    system = system_prompt(args.system_words)
    tags = itertools.count(200001)
    rows = []
    for name, with_long in (("plain streams alone", False), ("+ long prompts", True)):
        ttfts = []

        def long(stop):
            client = Client(url, timeout_s=600)
            while not stop.is_set():
                started = time.perf_counter()
                prompt = f"Ticket {next(tags)}. {system}\n\nQuestion: {QUESTIONS[0]}\nAnswer:"
                ttfts.append(client.generate(prompt, GenerationParams(max_tokens=2, num_draft_tokens=0),
                                             stream=True).ttft_s)
                stop.wait(max(0.0, args.long_every - (time.perf_counter() - started)))

        gaps = beside.phase(url, args.streams, args.max_tokens, args.seconds, long if with_long else None)
        ms = beside.gap_ms(gaps)
        long_ms = f"{statistics.median(ttfts) * 1e3:.0f}" if ttfts else ""
        rows.append(f"| {name} | {len(gaps)} | {ms[0]:.0f} | {ms[1]:.0f} | {ms[2]:.0f} | {len(ttfts) or ''} | "
                    f"{long_ms} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="a running server's gRPC host:port")
    p.add_argument("--metrics-url", help="its metrics host:port (the per-request cache columns need it)")
    p.add_argument("--pair", help="start a server for this pair (tiny | default | gpu-8b | gpu-small) instead of "
                                  "using --url")
    p.add_argument("--launcher-arg", action="append", default=[], help="with --pair: one more launcher argument")
    p.add_argument("--system-words", type=int, default=700, help="the shared system prompt's length in words")
    p.add_argument("--requests", type=int, default=6, help="timed requests of each kind")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K (the server's default if unset)")
    p.add_argument("--stall", action="store_true", help="plain streams' gaps beside long prompts (chunked prefill)")
    p.add_argument("--streams", type=int, default=4, help="--stall: plain streams")
    p.add_argument("--seconds", type=float, default=30.0, help="--stall: how long each phase runs")
    p.add_argument("--long-every", type=float, default=0.0,
                   help="--stall: a long prompt starts every this many seconds (0: one after another)")
    p.add_argument("--draft-model", help="the draft (a draft model's name, or ngram; the server's default if unset)")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    own = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our server
    try:
        if args.pair:
            cache = HERE.parent / ".cache"
            own = server.start(cache / "run" / f"bench-prefix-{args.pair}", cache / f"bench-prefix-{args.pair}.log",
                               [*pair_arguments(args.pair), *args.launcher_arg])
        url = own.grpc_url if own else args.url
        metrics_url = own.metrics_url if own else args.metrics_url
        started = time.perf_counter()
        if args.stall:
            lines = stall(url, args)
        else:
            rows, prompt_tokens = measure(url, metrics_url, args)
    finally:
        if own is not None:
            own.stop(120)
    if args.stall:
        title = (f"{args.pair or url} {' '.join(args.launcher_arg)}, {args.streams} plain streams (target-only, "
                 f"{args.max_tokens} tokens each), {args.seconds:g} s per phase, long prompts of a "
                 f"{args.system_words}-word system prompt {f'every {args.long_every:g} s' if args.long_every else 'one after another'}; {platform.machine()}, {os.cpu_count()} cores")
        columns = ["phase", "plain responses", "gap median ms", "gap p99 ms", "gap max ms", "long prompts",
                   "long prompt TTFT median ms"]
        table = "\n".join([title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns), *lines])
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
        return 0
    k = "server default" if args.num_draft_tokens is None else args.num_draft_tokens
    draft = args.draft_model or "the server's default draft"
    title = (f"{args.pair or url}, {min(prompt_tokens)}-{max(prompt_tokens)} prompt tokens ({args.system_words}-word system prompt), "
             f"{args.max_tokens} output tokens, {draft}, K {k}, {args.requests} requests of each kind, one at a time, "
             f"interleaved ({time.perf_counter() - started:.0f} s); {platform.machine()}, {os.cpu_count()} cores")
    columns = ["prompts", "TTFT p50 / p90 (ms)", "latency p50 / p90 (ms)", "output tokens/s p50",
               "target: prompt tokens found / looked up", "target / draft tokens run per request"]
    lines = []
    for kind, row in rows.items():
        use = row["usage"]
        found = (f"{use[('prefix_cache_hits_total', 'target_model')]:.0f} / "
                 f"{use[('prefix_cache_queries_total', 'target_model')]:.0f}") if use else ""
        ran = (f"{use[('tokens_processed_total', 'target_model')]:.0f} / "
               f"{use[('tokens_processed_total', 'draft_model')]:.0f}") if use else ""
        lines.append(f"| {kind} | {row['ttft'][0]:.0f} / {row['ttft'][1]:.0f} | {row['latency'][0]:.0f} / "
                     f"{row['latency'][1]:.0f} | {row['rate']:.1f} | {found} | {ran} |")
    ratio = rows["unique"]["ttft"][0] / rows["shared"]["ttft"][0]
    table = "\n".join([title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns), *lines, "",
                       f"TTFT p50, unique / shared: {ratio:.2f}x"])
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
