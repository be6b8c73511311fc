"""Concurrency benchmark: N concurrent streams, speculative vs target-only (num_draft_tokens=0), side by side.

    python loadtest/concurrency_bench.py --url localhost:8001 --concurrency 1 2 4 8 16 --requests-per-stream 3
    python loadtest/concurrency_bench.py --pair default --compare-unbatched --requests-per-level 16  # own servers
    python loadtest/concurrency_bench.py --pair default --compare-orchestrators 1 2 --concurrency 1 4 8
    python loadtest/concurrency_bench.py --pair tiny --compare-pipelined --concurrency 1 8

With --pair it starts a server for that pair itself; with --compare-unbatched it first measures a server
whose models run one forward per sequence (batched_forward=false), then the normal (batched) one, and
adds the batched / unbatched throughput ratio; with --compare-orchestrators, one server per number of
speculative_decoding instances, the ratio of the last to the first; with --compare-pipelined, a server
whose models answer from their own threads (pipelined_execute=true) against one that does not; --repeat N
starts the compared servers N times, interleaved (A, B, A, B), each run's throughput a column of its own.

For each concurrency level and mode it runs `concurrency` streaming clients, each sending its share of
requests back to back, and prints a Markdown table: output tokens/s (genai-perf: total output tokens /
(last response - first request)), TTFT p50, ITL p50, mean acceptance rate, and the speculative /
target-only throughput ratio measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

from tabulate import tabulate

from client import AsyncClient, GenerationParams
from specdec.serving import server

HERE = Path(__file__).resolve().parent


async def run_level(url, prompts, concurrency, per_stream, params, per_level=None):
    """`concurrency` streams send requests back to back: `per_stream` each, or with `per_level` that many
    in all (the same prompts at every level, so levels compare the same work), taken in turn."""
    results = []
    if per_level:
        jobs = [prompts[i % len(prompts)] for i in range(max(per_level, concurrency))]
    else:
        jobs = [prompts[(w * per_stream + i) % len(prompts)] for w in range(concurrency) for i in range(per_stream)]
    jobs.reverse()  # pop() takes them in order
    async with AsyncClient(url, "grpc") as client:
        async def stream_worker(worker):
            while jobs:
                results.append(await client.generate(jobs.pop(), params, stream=True))

        start = time.perf_counter()
        await asyncio.gather(*(stream_worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - start
    tokens = sum(r.num_output_tokens for r in results)
    drafted = sum(r.total_draft_tokens for r in results)
    return {
        "tokens_per_s": tokens / elapsed,
        "ttft_ms": statistics.median(r.ttft_s for r in results) * 1000,
        "itl_ms": statistics.median(r.itl_s for r in results if r.num_output_tokens > 1) * 1000,
        "acceptance": sum(r.total_accepted_draft_tokens for r in results) / drafted if drafted else 0.0,
        "requests": len(results),
    }


def start_server(pair: str, launcher_args: list[str]) -> server.ServerProcess:
    cache = HERE.parent / ".cache"
    return server.start(cache / "run" / f"bench-{pair}", cache / f"bench-concurrency-{pair}.log",
                        ["--pair", pair, *launcher_args])


def measure(url, prompts, levels, per_stream, per_level, base, spec) -> dict:
    asyncio.run(run_level(url, prompts, 2, 1, spec))  # warm up both paths before anything is timed
    rows = {}
    for concurrency in levels:
        rows[(concurrency, "target-only")] = asyncio.run(run_level(url, prompts, concurrency, per_stream, base, per_level))
        rows[(concurrency, "speculative")] = asyncio.run(run_level(url, prompts, concurrency, per_stream, spec, per_level))
        print(f"  {concurrency} streams: target-only {rows[(concurrency, 'target-only')]['tokens_per_s']:.1f}, "
              f"speculative {rows[(concurrency, 'speculative')]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--pair", help="start a server for this pair (tiny | default) instead of using --url")
    parser.add_argument("--compare-unbatched", action="store_true",
                        help="with --pair: also measure a server with batched_forward=false")
    parser.add_argument("--compare-orchestrators", type=int, nargs="+", metavar="N",
                        help="with --pair: one server per number of orchestrator instances, in this order")
    parser.add_argument("--compare-pipelined", action="store_true",
                        help="with --pair: the models synchronous, then with pipelined_execute=true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --compare-*: start the compared servers this many times, interleaved "
                             "(A, B, A, B): this machine's run-to-run spread shows beside the difference")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--requests-per-level", type=int, default=None,
                        help="instead: this many requests at every level, shared by its streams")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="speculative K (server default if unset)")
    parser.add_argument("--prompts-file", default=str(HERE / "prompts.jsonl"))
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    spec = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens)
    base = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=0)
    if (args.compare_unbatched or args.compare_orchestrators or args.compare_pipelined) and not args.pair:
        parser.error("--compare-* starts its own servers: give --pair")
    servers = {"batched": []}  # label -> launcher arguments
    if args.compare_unbatched:
        servers = {"unbatched": ["--set", "target_model.batched_forward=false",
                                 "--set", "draft_model.batched_forward=false"], "batched": []}
    elif args.compare_pipelined:
        servers = {"synchronous": [], "pipelined": [arg for model in ("target_model", "draft_model") for arg in
                                                    ("--set", f"{model}.pipelined_execute=true")]}
    elif args.compare_orchestrators:
        servers = {f"{n} orchestrator{'s' if n > 1 else ''}": [f"--orchestrator-instances={n}"]
                   for n in args.compare_orchestrators}
    if args.repeat > 1:
        servers = {f"{label}{f' #{n + 1}' if n else ''}": launcher_args for n in range(args.repeat)
                   for label, launcher_args in servers.items()}
    measured = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our server
    for label, launcher_args in servers.items():
        own = start_server(args.pair, launcher_args) if args.pair else None
        url = own.grpc_url if own else args.url
        try:
            print(f"measuring the {label} server at {url}", file=sys.stderr, flush=True)
            measured[label] = measure(url, prompts, args.concurrency, args.requests_per_stream, args.requests_per_level,
                                     base, spec)
        finally:
            if own is not None:
                own.stop(120)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"pair {args.pair or args.url}; max_tokens {args.max_tokens}; " + (
              f"{args.requests_per_level} requests per level" if args.requests_per_level else
              f"{args.requests_per_stream} requests per stream"))
    print()
    # With several servers: each one's throughput and the last / first ratio; the other columns are the last's.
    labels = list(measured)
    first, last = labels[0], labels[-1]
    compared = len(labels) > 1
    header = ["streams", "mode"] + ([f"{label} tokens/s" for label in labels] + [f"{last} / {first}"] if compared
                                    else ["output tokens/s"])
    header += ["TTFT p50 (ms)", "ITL p50 (ms)", "acceptance", "vs target-only" + (f" ({last})" if compared else "")]
    rows = []
    final = measured[last]
    for concurrency in args.concurrency:
        for mode in ("target-only", "speculative"):
            row = final[(concurrency, mode)]
            ratio = row["tokens_per_s"] / final[(concurrency, "target-only")]["tokens_per_s"]
            throughput = [f"{measured[label][(concurrency, mode)]['tokens_per_s']:.1f}" for label in labels]
            if compared:
                throughput.append(f"{row['tokens_per_s'] / measured[first][(concurrency, mode)]['tokens_per_s']:.2f}x")
            rows.append([concurrency, mode, *throughput, f"{row['ttft_ms']:.0f}", f"{row['itl_ms']:.1f}",
                         f"{row['acceptance']:.2f}", f"{ratio:.2f}x"])
    print(tabulate(rows, header, tablefmt="github", disable_numparse=True), flush=True)


if __name__ == "__main__":
    main()
