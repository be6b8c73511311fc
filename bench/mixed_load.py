"""Concurrent streams of different kinds against a running server: do their steps share the models' executions?

Each mix runs --streams clients for --seconds, each sending requests back to back (the prompts of
loadtest/guided.jsonl in the chat template, greedy, --max-tokens each), and prints output tokens/s, the
target's steps per execution (Triton's request and execution counters) and, with --launcher-pid, the CPU
seconds tritonserver and the stubs used meanwhile:

  k0              every stream target-only (K=0)
  k0-k4           half the streams K=0, half K=4 fixed (prompt lookup)
  default         the server's defaults (its draft method, adaptive K)
  default-guided  the same, half the streams asking for the row's structured output

Triton's sequence batcher puts steps into one execution only when they carry the same inputs: mixes of kinds show whether they do.

    make serve &
    python -m bench.mixed_load --url localhost:8001 --metrics-url localhost:8002 \\
        --launcher-pid $(pgrep -f specdec.serving.launcher)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

from client import Client, GenerationParams
from bench.report import print_table
from bench.round_overhead import server_cpu
from specdec.serving.metrics_text import scrape, sum_samples

HERE = Path(__file__).resolve().parent

MIXES = ("k0", "k0-k4", "default", "default-guided")
PROCESSES = ("tritonserver", "target_model", "draft_model", "speculative_decoding")


def stream_params(mix: str, stream: int, row: dict, max_tokens: int) -> GenerationParams:
    """What stream number `stream` of a mix sends for a guided.jsonl row."""
    guided = mix == "default-guided" and stream % 2 == 0
    k = {"k0": 0, "k0-k4": 4 * (stream % 2)}.get(mix)
    guide = row["guide"] if isinstance(row["guide"], str) else json.dumps(row["guide"])
    return GenerationParams(max_tokens=max_tokens, num_draft_tokens=k, adaptive_draft=False if k is not None else None,
                            draft_model="ngram" if k else None, apply_chat_template=True,
                            guide_type=row["guide_type"] if guided else None, guide=guide if guided else None)


def run_mix(args, mix: str, rows: list[dict]) -> list[str]:
    def target(name: str) -> float:
        return sum_samples(scrape(args.metrics_url), name, model="target_model")

    tokens, stop = [0] * args.streams, time.monotonic() + args.seconds

    def stream(i: int) -> None:
        client = Client(args.url, timeout_s=600)
        j = i
        while time.monotonic() < stop:
            tokens[i] += client.generate(rows[j % len(rows)]["prompt"],
                                         stream_params(mix, i, rows[j % len(rows)], args.max_tokens)).num_output_tokens
            j += 1

    cpu = server_cpu(args.launcher_pid) if args.launcher_pid else {}
    steps, executions = target("nv_inference_request_success"), target("nv_inference_exec_count")
    started = time.monotonic()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    per_execution = ((target("nv_inference_request_success") - steps)
                     / max(target("nv_inference_exec_count") - executions, 1))
    used = server_cpu(args.launcher_pid) if args.launcher_pid else {}
    return [mix, f"{sum(tokens) / wall:.1f}", f"{per_execution:.2f}",
            *(f"{used.get(name, 0.0) - cpu.get(name, 0.0):.1f}" if used else "" for name in PROCESSES)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC host:port")
    p.add_argument("--metrics-url", default="localhost:8002", help="its metrics host:port")
    p.add_argument("--launcher-pid", type=int, help="the launcher's process id: CPU seconds per process (Linux)")
    p.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in (HERE.parent / "loadtest" / "guided.jsonl").read_text().splitlines() if line]
    table = [run_mix(args, mix, rows) for mix in args.mixes]
    print_table(f"{platform.processor() or platform.machine()}, {args.streams} streams, {args.seconds:g} s per mix, "
                f"{args.max_tokens} tokens per request, served at {args.url}", table,
                ["mix", "tokens/s", "target steps per execution", *(f"CPU s: {name}" for name in PROCESSES)], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
