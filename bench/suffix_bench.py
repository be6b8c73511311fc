"""Suffix drafting against prompt lookup on workloads that repeat across requests (`make bench-suffix`).

`suffix` drafts from the request's own tokens and from earlier requests' prompts and outputs (a cache per
orchestrator instance); `ngram` from the request's own only. Two workloads, each a set of prompts sent
one at a time, greedy (or seeded sampled with --temperature), through the served `ensemble`:

  templated   different inputs, one output format (a JSON record per fictional person, the same fields):
              later answers repeat the earlier ones' skeleton
  repeated    the open-ended prompts of bench/prompts_open.jsonl, each sent once (first pass) and then
              again (second pass; sampled: with another seed)

Every request finished feeds the cache, whatever its method, so the order is fixed: on a fresh server
(one orchestrator instance, so that one cache sees everything) each workload runs with `suffix` first
(the repeated one: both passes), then target-only, then `ngram`; side by side in one run. Rows: tokens/s,
speedup over target-only, acceptance, tokens per round, and (greedy) the fraction of requests whose text
equals target-only's: all of them. Sampled, a seeded request's tokens depend on its draft lengths.

    python -m bench.suffix_bench [--max-tokens 96] [--temperature 0.7] [--out table.md]
    python -m bench.suffix_bench --cache-cost [--cache-tokens 262144] [--vocab 49152]   # the cache alone,
        # in process: its memory a token when full, and what adding a request and a lookup cost
    python -m bench.suffix_bench --url localhost:8001 --pair tiny   # a running server: one orchestrator
                                                                     # instance, and no earlier requests
                                                                     # of these prompts, for figures that mean this
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from client import Client, GenerationParams
from bench.report import cpu_name, print_table
from specdec import tensor_names as tn
from specdec.serving import pairs, server

HERE = Path(__file__).resolve().parent

PEOPLE = [("Ada", "a lighthouse keeper in Norway"), ("Bruno", "a baker in Lyon"),
          ("Chen", "a violin maker in Taipei"), ("Dalia", "a marine biologist in Cairo"),
          ("Emeka", "a taxi driver in Lagos"), ("Freya", "a beekeeper in Oslo"),
          ("Gustavo", "a chess coach in Lima"), ("Hana", "a potter in Kyoto")]
TEMPLATE = ("Write a JSON object describing {name}, {who}. Use exactly these fields: name, age, city, "
            "occupation, hobbies (a list of three), and a one-sentence bio.")


def workloads(prompts: int) -> dict[str, list[str]]:
    open_ended = [json.loads(line)["prompt"] for line in (HERE / "prompts_open.jsonl").read_text().splitlines()
                  if line.strip()][:prompts]
    return {"templated": [TEMPLATE.format(name=name, who=who) for name, who in PEOPLE[:prompts]],
            "repeated": open_ended}


def run(client: Client, prompts: list[str], params: GenerationParams) -> dict:
    out = dict(tokens=0, s=0.0, drafted=0, accepted=0, rounds=0, texts=[])
    for prompt in prompts:
        result = client.generate(prompt, params)
        out["tokens"] += result.num_output_tokens
        out["s"] += result.latency_s
        out["drafted"] += result.total_draft_tokens
        out["accepted"] += result.total_accepted_draft_tokens
        out["rounds"] += result.num_rounds
        out["texts"].append(result.text)
    return out


def cache_cost(tokens: int, vocab: int, out: str | None) -> int:
    """The suffix cache in process, no server: filled to `tokens` with sequences of 100-400 random ids (seed
    0), its memory (tracemalloc) a token; then as many tokens again added at full (each request evicting the
    oldest, the orchestrator's steady state) and 20,000 lookups of 10-token suffixes, half of them cached."""
    import gc
    import random
    import time
    import tracemalloc

    from specdec.decoding.suffix_proposer import SuffixCache

    rng = random.Random(0)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(100, 401))] for _ in range(3 * tokens // 250)]
    fill, steady = sequences[:len(sequences) // 2], sequences[len(sequences) // 2:]
    gc.collect()
    tracemalloc.start()
    cache = SuffixCache(tokens)
    for sequence in fill:
        cache.add(sequence)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    start = time.perf_counter()
    for sequence in steady:
        cache.add(sequence)
    add_s = time.perf_counter() - start
    kept = list(cache.sequences.values())
    queries = [list(seq[end - 10:end]) for seq in rng.choices(kept, k=10000)
               for end in [rng.randrange(10, len(seq))]] + [[rng.randrange(vocab) for _ in range(10)]
                                                           for _ in range(10000)]
    start = time.perf_counter()
    hits = sum(cache.lookup(query, 4)[0] > 0 for query in queries)
    lookup_s = time.perf_counter() - start
    added = sum(map(len, steady))
    header = (f"{cpu_name()}, Python {platform.python_version()}: a SuffixCache of {tokens} tokens, "
              f"random ids below {vocab}")
    print_table(header, [[f"{cache.tokens}", f"{memory / 2**20:.1f} MiB", f"{memory / cache.tokens:.0f}",
                          f"{add_s / added * 1e6:.2f}", f"{lookup_s / len(queries) * 1e6:.2f}",
                          f"{hits} of {len(queries)}"]],
                ["tokens kept", "memory", "bytes a token", "add at full, µs a token", "lookup, µs", "hits"], out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's gRPC address instead of starting one (--pair: its pair)")
    parser.add_argument("--pair", default="default", choices=sorted(pairs.PAIRS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload (at most 8)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=16, help="the most a round drafts (adaptive)")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling (seed per prompt)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--cache-cost", action="store_true", help="measure the cache alone, in process (no server)")
    parser.add_argument("--cache-tokens", type=int, default=262144, help="--cache-cost: the cache's budget")
    parser.add_argument("--vocab", type=int, default=49152, help="--cache-cost: ids below this")
    args = parser.parse_args(argv)
    if args.cache_cost:
        return cache_cost(args.cache_tokens, args.vocab, args.out)
    cache = pairs.cache_dir()
    own = None if args.url else server.start(cache / "run" / "bench-suffix", cache / "bench-suffix-server.log",
                                             ["--pair", args.pair, "--orchestrator-instances", "1"])
    rows = []
    try:
        client = Client(args.url or own.grpc_url, "grpc", timeout_s=600)
        client.generate("Hello", GenerationParams(max_tokens=8, num_draft_tokens=0))  # warm the path
        for workload, prompts in workloads(args.prompts).items():
            def params(method: str | None, k: int, seed: int = 7) -> GenerationParams:
                return GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=k, draft_model=method,
                                        temperature=args.temperature, seed=seed if args.temperature else None,
                                        ignore_eos=True, apply_chat_template=True)
            # suffix first: every finished request feeds the cache, target-only and ngram ones too.
            results = {f"{tn.SUFFIX}, adaptive K<={args.k}": run(client, prompts, params(tn.SUFFIX, args.k))}
            if workload == "repeated":
                results[f"{tn.SUFFIX}, adaptive K<={args.k}, second pass"] = run(
                    client, prompts, params(tn.SUFFIX, args.k, seed=8))
            results["target-only"] = run(client, prompts, params(None, 0))
            results[f"{tn.NGRAM}, adaptive K<={args.k}"] = run(client, prompts, params(tn.NGRAM, args.k))
            base = results["target-only"]
            for name in sorted(results, key=lambda name: (name != "target-only", not name.startswith(tn.NGRAM), name)):
                r = results[name]
                tps = r["tokens"] / r["s"]
                # Sampled, a seeded request's tokens depend on its draft lengths: equal text is not expected.
                equal = sum(a == b for a, b in zip(r["texts"], base["texts"])) / len(prompts)
                rows.append([workload, name, f"{tps:.1f}", f"{tps / (base['tokens'] / base['s']):.2f}x",
                             f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "",
                             f"{r['tokens'] / r['rounds']:.2f}", "" if args.temperature else f"{equal:.0%}"])
                print(f"  {workload:9s} {name:36s} {tps:6.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        if own is not None:
            own.stop()
    mode = f"sampled (temperature {args.temperature:g}, seeded)" if args.temperature else "greedy"
    header = (f"{platform.machine()} CPU, {args.pair} pair, {mode}, {args.max_tokens} tokens per request "
              f"(ignore_eos), one request at a time, one orchestrator instance")
    print_table(header, rows, ["workload", "method", "tokens/s", "vs target-only", "acceptance", "tokens/round",
                               "equal text"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
