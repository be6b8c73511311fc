"""Concurrency benchmark: N concurrent streams, speculative vs target-only (num_draft_tokens=0), side by side.

    python loadtest/concurrency_bench.py --url localhost:8001 --concurrency 1 2 4 8 --requests-per-stream 3

For each concurrency level and mode it runs `concurrency` streaming clients, each sending its share of
requests back to back, and prints a Markdown table: output tokens/s (genai-perf: total output tokens /
(last response - first request)), TTFT p50, ITL p50, mean acceptance rate, and the speculative /
target-only throughput ratio measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import os
import statistics
import time
from pathlib import Path

from client import AsyncClient, GenerationParams

HERE = Path(__file__).resolve().parent


async def run_level(url, prompts, concurrency, per_stream, params):
    results = []
    async with AsyncClient(url, "grpc") as client:
        async def stream_worker(worker):
            for i in range(per_stream):
                prompt = prompts[(worker * per_stream + i) % len(prompts)]
                results.append(await client.generate(prompt, params, stream=True))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="speculative K (server default if unset)")
    parser.add_argument("--prompts-file", default=str(HERE / "prompts.jsonl"))
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    spec = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens)
    base = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"server {args.url}; max_tokens {args.max_tokens}; {args.requests_per_stream} requests per stream")
    print()
    print("| streams | mode | output tokens/s | TTFT p50 (ms) | ITL p50 (ms) | acceptance | speedup |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for concurrency in args.concurrency:
        target_only = asyncio.run(run_level(args.url, prompts, concurrency, args.requests_per_stream, base))
        speculative = asyncio.run(run_level(args.url, prompts, concurrency, args.requests_per_stream, spec))
        for mode, row in (("target-only", target_only), ("speculative", speculative)):
            ratio = row["tokens_per_s"] / target_only["tokens_per_s"]
            print(f"| {concurrency} | {mode} | {row['tokens_per_s']:.1f} | {row['ttft_ms']:.0f} | {row['itl_ms']:.1f} | "
                  f"{row['acceptance']:.2f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
