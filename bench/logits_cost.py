"""What TensorRT-LLM's logits outputs cost a client: the same greedy request with and without
`return_generation_logits` (and with `return_context_logits` too), over Triton's gRPC stream and its HTTP
generate endpoint, streamed and whole, on a running server (the ensemble; `client.sync.Client`).

Each setting's requests run interleaved with the plain one's (A B B A ...), one at a time; it prints the
median wall time per request, the logits' bytes per generated token, and checks that asking changes nothing
in the text.

    make serve &   # the default pair; Triton's gRPC at localhost:8001, HTTP at localhost:8000
    python -m bench.logits_cost
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench import report
from client import Client, GenerationParams

PROMPT = "Write a short paragraph about the history of the printing press."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc", default="localhost:8001")
    parser.add_argument("--http", default="http://localhost:8000")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens a request")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    base = GenerationParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    settings = {"plain": {}, "generation logits": {"return_generation_logits": True},
                "generation + context logits": {"return_generation_logits": True, "return_context_logits": True}}
    rows = []
    for protocol, url in (("grpc", args.grpc), ("http", args.http)):
        client = Client(url, protocol=protocol)
        for stream in (True, False):
            times: dict[str, list[float]] = {name: [] for name in settings}
            texts: dict[str, set[str]] = {name: set() for name in settings}
            size = 0
            client.generate(PROMPT, base, stream=stream)  # warm
            for repeat in range(args.repeats):
                order = list(settings) if repeat % 2 == 0 else list(settings)[::-1]
                for name in order:
                    params = GenerationParams(**{**base.__dict__, **settings[name]})
                    started = time.perf_counter()
                    result = client.generate(PROMPT, params, stream=stream)
                    times[name].append(time.perf_counter() - started)
                    texts[name].add(result.text)
                    if result.generation_logits is not None:
                        size = result.generation_logits.shape[-1] * 4
            plain = statistics.median(times["plain"])
            for name in settings:
                median = statistics.median(times[name])
                rows.append([protocol, "streamed" if stream else "whole", name, f"{median * 1000:.0f}",
                             f"{median / plain:.2f}", f"{(median - plain) * 1000 / args.tokens:.2f}",
                             "-" if name == "plain" else f"{size // 1024} KiB",
                             "yes" if texts[name] == texts["plain"] and len(texts[name]) == 1 else "NO"])
    text = report.print_table(
        f"{args.tokens}-token greedy requests, median of {args.repeats}, one at a time ({report.machine()})", rows,
        ["protocol", "answer", "asked", "ms a request", "vs plain", "ms more a token", "logits a token",
         "text = plain"])
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
