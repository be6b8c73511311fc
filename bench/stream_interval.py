"""What a whole answer costs by how the server sends it (`python -m bench.stream_interval`): one response at
the end (a request that is not streamed: a cancel does not reach it through the ensemble), a streamed response
per round (a cancel stops it within a round; each response pays the ensemble's postprocessing step), or
streamed at most every `stream_interval_ms` (what the OpenAI API asks for the answers it sends whole: a cancel
stops it within the interval and a round, the step paid a few times a second).

One tiny-pair server (or `--pair default`), greedy requests of fixed length at K=0 and K=4, one at a time,
the three ways alternating request by request so that the machine's drift falls on all of them alike; per
way: the client's wall time per round and the responses per request.

    python -m bench.stream_interval [--pair default] [--interval-ms 100] [--repeats 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from bench.report import print_table
from bench.round_overhead import served_pair
from client import Client, GenerationParams
from specdec.serving import pairs, server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--interval-ms", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    label, pair_args = served_pair(args.pair, "cpu")
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    ways = {"whole (one response)": (False, None), "streamed, a response per round": (True, None),
            f"streamed, at most one per {args.interval_ms} ms": (True, args.interval_ms)}
    cache = pairs.cache_dir()
    own = server.start(cache / "run" / "bench-stream-interval", cache / "bench-stream-interval.log", pair_args)
    rows = []
    try:
        client = Client(own.grpc_url, "grpc", timeout_s=600)
        for k in (0, 4):
            per_round = {way: [] for way in ways}
            responses = {way: [] for way in ways}
            for repeat in range(args.repeats + 1):  # the first: warm-up, not counted
                for prompt in prompts:
                    for way, (stream, interval) in ways.items():
                        params = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=k,
                                                  adaptive_draft=False, ignore_eos=True, temperature=0.0,
                                                  stream_interval_ms=interval)
                        chunks = []
                        started = time.perf_counter()
                        result = client.generate(prompt, params, stream=stream,
                                                 on_text=chunks.append if stream else None)
                        wall = time.perf_counter() - started
                        if repeat:
                            per_round[way].append(wall / max(result.num_rounds, 1) * 1e3)
                            responses[way].append(len(chunks) if stream else 1)
            for way in ways:
                rows.append([f"K={k}", way, f"{statistics.median(per_round[way]):.2f}",
                             f"{statistics.mean(responses[way]):.1f}"])
    finally:
        own.stop()
    header = (f"{platform.machine()} cpu, {label}, greedy, {args.max_tokens} tokens per request, one at a time, "
              f"the ways alternating ({args.repeats} x {len(prompts)} requests each; medians)")
    print_table(header, rows, ["", "how the server sends it", "ms per round (client wall / rounds)",
                               "responses per request"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
