"""Structured output under speculation, in process (`make bench-structured`): what the grammar's forced text
proposed as drafts is worth, against target-only decoding and prompt lookup alone, no server.

For each JSON schema, with JSON's optional whitespace allowed (llguidance's default) or not
(`"x-guidance": {"whitespace_flexible": false}`), greedy, it runs the real decode loop on the pair's target:

  target-only        K = 0 (nothing is proposed, forced text included)
  lookup             prompt lookup, K fixed, the grammar's forced text not proposed
  lookup + forced    the same, with forced text proposed free where the grammar has some (the default)

interleaved over --repeats, and prints tokens, rounds, tokens per round, tokens/s, the speedup over
target-only and whether the three outputs are equal (they must be).

With --url, the same requests go through a running server's ensemble instead (`make serve`; gRPC): target-only
against prompt lookup with K fixed (the server proposes forced text), each request's tokens/s from the client.

With --url and --stall, what guides cost other requests: --streams plain streamed requests (target-only) run
for --seconds alone, then beside a client sending one guided request after another (a large JSON schema,
--schema-objects objects of 6 fields, 60 by default; 4 tokens each), the same schema every time or a schema
new to the server every time, and it prints the gaps between the plain streams' responses (median, p99, max)
and the guided requests' latency. A guide compiles for milliseconds; where that runs on the orchestrator's event loop every other
request's round waits for it.

    python -m bench.structured_bench                       # the default pair (SmolLM2-135M-Instruct)
    python -m bench.structured_bench --pair tiny --max-tokens 24 --repeats 1
    python -m bench.structured_bench --url localhost:8001  # served
    python -m bench.structured_bench --url localhost:8001 --stall
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.grammar import GrammarMatcher, GuideCompiler
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.text import load_tokenizer
from specdec.engine.build import dynamic_executor
from specdec.engine.loading import load_causal_lm
from specdec.engine.local import LocalScorer
from specdec.serving import pairs

CASES = [
    ("person", "Describe a fictional person as JSON.",
     {"type": "object", "required": ["name", "age", "city", "occupation", "hobbies"],
      "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                     "occupation": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}}}),
    ("book", "Recommend a classic novel as JSON.",
     {"type": "object", "required": ["title", "author", "year", "genre", "rating"],
      "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                     "genre": {"type": "string"}, "rating": {"type": "number"}}}),
]
MODES = ("target-only", "lookup", "lookup + forced")


async def _run(lm, tokenizer, grammar, prompt_ids, max_tokens, k):
    stats = Stats()
    req = GenerationRequest(seq_id=1, prompt_ids=prompt_ids, max_tokens=max_tokens, grammar=grammar,
                            end_ids=frozenset([tokenizer.eos_token_id]))
    started = time.perf_counter()
    tokens = [t async for rnd in generate(req, NgramProposer(), LocalScorer(lm), DraftLengthPolicy.fixed(k), stats)
              for t in rnd.new_tokens]
    return tokens, stats, time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("default", "tiny"), default="default")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--url", help="a running server's gRPC host:port: measure served requests")
    p.add_argument("--stall", action="store_true", help="with --url: other streams' gaps while guides compile")
    p.add_argument("--streams", type=int, default=4, help="--stall: plain streams")
    p.add_argument("--seconds", type=float, default=20.0, help="--stall: how long each phase runs")
    p.add_argument("--schema-objects", type=int, default=60, help="--stall: objects (of 6 fields) in the guided schema")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    if args.url:
        return _stall(args) if args.stall else _served(args)
    torch.set_num_threads(args.threads)
    pair = pairs.default_pair() if args.pair == "default" else pairs.tiny_pair()
    tokenizer = load_tokenizer(pair.tokenizer_path)
    lm = dynamic_executor(load_causal_lm(pair.target_path, "cpu", pair.dtype))
    guides = GuideCompiler(tokenizer)
    forced = GrammarMatcher.forced
    rows = []
    for name, prompt, schema in CASES:
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"]
                          if tokenizer.chat_template else tokenizer.encode(prompt))
        for flexible in (True, False):
            guide = schema if flexible else {**schema, "x-guidance": {"whitespace_flexible": False}}
            grammar = guides.compile("json_schema", json.dumps(guide))
            seconds = {mode: [] for mode in MODES}
            outputs = {}
            for _ in range(args.repeats):
                for mode in MODES:  # interleaved: this machine's speed drifts
                    GrammarMatcher.forced = forced if mode == "lookup + forced" else (lambda self, limit: [])
                    try:
                        k = 0 if mode == "target-only" else args.num_draft_tokens
                        tokens, stats, took = asyncio.run(_run(lm, tokenizer, grammar, prompt_ids, args.max_tokens, k))
                    finally:
                        GrammarMatcher.forced = forced
                    seconds[mode].append(took)
                    outputs[mode] = (tokens, stats)
            base = len(outputs["target-only"][0]) / statistics.median(seconds["target-only"])
            equal = len({tuple(tokens) for tokens, _ in outputs.values()}) == 1
            for mode in MODES:
                tokens, stats = outputs[mode]
                rate = len(tokens) / statistics.median(seconds[mode])
                rows.append(f"| {name} | {'flexible' if flexible else 'compact'} | {mode} | {len(tokens)} | {stats.rounds} | "
                            f"{len(tokens) / stats.rounds:.2f} | {stats.accepted}/{stats.drafted} | {rate:.1f} | "
                            f"{rate / base:.2f}x | {'yes' if equal else 'NO'} |")
    return _report(f"{args.pair} pair, greedy, K={args.num_draft_tokens}, max_tokens={args.max_tokens}, {args.threads} "
                   f"torch threads, median of {args.repeats} interleaved runs, {platform.processor() or platform.machine()}",
                   ["schema", "whitespace", "proposals", "tokens", "rounds", "tokens/round", "accepted/drafted",
                    "tokens/s", "vs target-only", "equal text"], rows, args.out)


def _report(title: str, columns: list[str], rows: list[str], out: str | None, compares_text: bool = True) -> int:
    """Print (and with `out` write) the table; exit status 1 when some mode's text differed (rows that
    compare text end with their "equal text" column)."""
    table = "\n".join([title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns), *rows])
    print(table)
    if out:
        Path(out).write_text(table + "\n")
    return 0 if not compares_text or all(row.endswith("yes |") for row in rows) else 1


def _served(args) -> int:
    from client import Client, GenerationParams

    client = Client(args.url)
    rows = []
    for name, prompt, schema in CASES:
        for flexible in (True, False):
            guide = json.dumps(schema if flexible else {**schema, "x-guidance": {"whitespace_flexible": False}})
            rates, results = {0: [], args.num_draft_tokens: []}, {}
            for _ in range(args.repeats):
                for k in rates:  # interleaved
                    result = client.generate(prompt, GenerationParams(
                        max_tokens=args.max_tokens, num_draft_tokens=k, adaptive_draft=False, draft_model="ngram",
                        apply_chat_template=True, guide_type="json_schema", guide=guide))
                    rates[k].append(result.tokens_per_s)
                    results[k] = result
            base, fast = (statistics.median(rates[k]) for k in rates)
            spec = results[args.num_draft_tokens]
            rows.append(f"| {name} | {'flexible' if flexible else 'compact'} | {spec.num_output_tokens} | {base:.1f} | "
                        f"{fast:.1f} | {fast / base:.2f}x | {spec.num_output_tokens / spec.num_rounds:.2f} | "
                        f"{'yes' if results[0].text == spec.text else 'NO'} |")
    return _report(f"served at {args.url}, greedy, prompt lookup K={args.num_draft_tokens} fixed, "
                   f"max_tokens={args.max_tokens}, median of {args.repeats} interleaved requests",
                   ["schema", "whitespace", "tokens", "target-only tokens/s", f"K={args.num_draft_tokens} tokens/s",
                    "speedup", "tokens/round", "equal text"], rows, args.out)


def _large_schema(tag: str, objects: int = 60) -> str:
    """A JSON schema of `objects` objects of 6 fields each; `tag` in its names makes it new to the server."""
    fields = {f"sub_{tag}_{j}": {"type": ["string", "integer"]} for j in range(6)}
    return json.dumps({"type": "object", "properties": {f"field_{tag}_{i}": {"type": "object", "properties": fields}
                                                        for i in range(objects)}})


def _stall(args) -> int:
    import itertools

    import beside
    from client import Client, GenerationParams

    rows, failures = [], []
    unique = itertools.count()
    for phase, tags in (("plain streams alone", None), ("+ the same schema again and again", itertools.repeat("same")),
                        ("+ a schema new to the server each time", (f"n{os.getpid()}x{i}" for i in unique))):
        latencies = []

        def guided(stop):
            client = Client(args.url)
            while not stop.is_set():
                started = time.perf_counter()
                guide = _large_schema(next(tags), args.schema_objects)
                try:
                    client.generate("Answer in JSON.", GenerationParams(max_tokens=4, num_draft_tokens=0,
                                                                        guide_type="json_schema", guide=guide))
                except Exception as exc:  # noqa: BLE001 - counted, and the run goes on
                    failures.append(str(exc))
                    continue
                latencies.append(time.perf_counter() - started)

        gaps = beside.phase(args.url, args.streams, args.max_tokens, args.seconds, guided if tags is not None else None)
        ms = beside.gap_ms(gaps)
        guided_ms = f"{statistics.median(latencies) * 1e3:.1f}" if latencies else ""
        rows.append(f"| {phase} | {len(gaps)} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {len(latencies) or ''} | "
                    f"{guided_ms} |")
    _report(f"served at {args.url}, {args.streams} plain streams (target-only, {args.max_tokens} tokens each), "
            f"{args.seconds:g} s per phase, a schema of {args.schema_objects} objects "
            f"({len(_large_schema('x', args.schema_objects))} characters)",
            ["phase", "plain responses", "gap median ms", "gap p99 ms", "gap max ms", "guided requests",
             "guided latency median ms"], rows, args.out, compares_text=False)
    if failures:  # exit status 1, naming the first
        print(f"{len(failures)} guided requests failed, e.g.: {failures[0]}")
    return int(bool(failures))


if __name__ == "__main__":
    sys.exit(main())
