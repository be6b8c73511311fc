"""Request priority under saturation, served (`make bench-priority`): what a lower `priority` buys a request
while the server is full.

A server whose live-sequence cap (`max_live_sequences`, --slots) is far below the load: --background streams
send requests back to back at priority 0 (the default), keeping every slot taken and a line waiting, while one
more client sends --urgent requests one after another. Two phases on the same server, alternating --rounds
times: the urgent requests at priority 0 (they wait in line like the others) and at priority -1 (they go
first). Printed per phase: the urgent requests' time to first token (request sent -> first text; it is mostly
the wait for a slot), and the background requests' in the same phase (what they give up).

    python -m bench.priority_bench                         # the tiny pair, a server of its own (2 slots)
    python -m bench.priority_bench --pair default --slots 4 --background 16
    python -m bench.priority_bench --url localhost:8001    # a running server (its own cap)
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.report import emit, machine, table
from client import Client, GenerationParams
from specdec.serving import server

HERE = Path(__file__).resolve().parent
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List five uses for a paper clip.", "Describe a walk through a pine forest."]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def background(url: str, max_tokens: int, stop: threading.Event, ttfts: list[float], index: int) -> None:
    """Requests at the default priority, back to back, until `stop`: each one's TTFT."""
    client = Client(url, "grpc")
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    while not stop.is_set():
        ttfts.append(client.generate(PROMPTS[index % len(PROMPTS)], params, stream=True).ttft_s)


def phase(url: str, args, priority: int) -> tuple[list[float], list[float]]:
    """(urgent TTFTs, background TTFTs) with the urgent requests at `priority`."""
    stop, behind = threading.Event(), []
    threads = [threading.Thread(target=background, args=(url, args.max_tokens, stop, behind, i), daemon=True)
               for i in range(args.background)]
    for thread in threads:
        thread.start()
    time.sleep(args.settle)  # every slot taken, a line waiting
    client, urgent = Client(url, "grpc"), []
    params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, priority=priority)
    for i in range(args.urgent):
        urgent.append(client.generate(PROMPTS[i % len(PROMPTS)], params, stream=True).ttft_s)
    stop.set()
    for thread in threads:
        thread.join()
    return urgent, behind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="tiny", help="start a server of this pair (ignored with --url)")
    p.add_argument("--url", help="a running server's gRPC address instead")
    p.add_argument("--slots", type=int, default=2, help="max_live_sequences of the server started here")
    p.add_argument("--background", type=int, default=8, help="streams at priority 0, back to back")
    p.add_argument("--urgent", type=int, default=6, help="urgent requests per phase, one after another")
    p.add_argument("--rounds", type=int, default=2, help="each phase this many times, alternating")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--settle", type=float, default=2.0, help="seconds of background load before the urgent client")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    own = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our server
    try:
        if args.url is None:
            cache = HERE.parent / ".cache"
            own = server.start(cache / "run" / f"bench-priority-{args.pair}", cache / f"bench-priority-{args.pair}.log",
                               ["--pair", args.pair, "--set", f"speculative_decoding.max_live_sequences={args.slots}"])
        url = own.grpc_url if own else args.url
        results = {0: ([], []), -1: ([], [])}
        for _ in range(args.rounds):
            for priority in (0, -1):
                urgent, behind = phase(url, args, priority)
                results[priority][0].extend(urgent)
                results[priority][1].extend(behind)
    finally:
        if own is not None:
            own.stop(120)

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f} / {percentile(values, 0.9) * 1000:.0f}"

    rows = [[f"urgent at priority {priority}", ms(urgent), len(urgent), ms(behind), len(behind)]
            for priority, (urgent, behind) in results.items()]
    gain = statistics.median(results[0][0]) / statistics.median(results[-1][0])
    slots = args.slots if own else "the server's"
    text = "\n".join([
        f"{args.pair if own else url}: {slots} slots (max_live_sequences), {args.background} background streams at "
        f"priority 0 back to back, {args.urgent} urgent requests per phase one after another, {args.max_tokens} "
        f"tokens each (greedy, the server's default draft), {args.rounds} rounds of each phase alternating; "
        f"{machine()}", "",
        table(rows, ["phase", "urgent TTFT p50 / p90 (ms)", "urgent requests", "background TTFT p50 / p90 (ms)",
                     "background requests"]), "",
        f"urgent TTFT p50, priority 0 / priority -1: {gain:.1f}x"])
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
