"""Two servers of one pair side by side, one change between them (`make bench-ab`).

A change to a kernel, a parameter or the environment moves a served figure by less than this 2-core
machine drifts between two runs (10-20 %): two benches one after the other cannot tell it. Here both
servers run at once (started here from the same checkout, each with its own launcher arguments and
environment, or given as running servers) and every request goes to both, one after the other, the order
alternating from prompt to prompt, so both see the same moments of the machine. Per prompt set and
setting: each server's tokens/s, B over A, each server's speedup over its own target-only row, tokens
per round, and whether the texts are equal (greedy: they must be, unless the change is meant to change
the numbers: the count is reported, not enforced).

    python -m bench.ab_bench --b-arg=--set=speculative_decoding.torch_threads=auto
    python -m bench.ab_bench --a-env GOMP_SPINCOUNT=30000 --b-env GOMP_SPINCOUNT=3000 --settings target-only,head-k3
    python -m bench.ab_bench --a-url localhost:8101 --b-url localhost:8201   # two servers already running
                                                                               # (e.g. from two checkouts)
    python -m bench.ab_bench --stream --settings target-only,default          # responses streamed, as clients
                                                                               # ask (default: one a request)
    python -m bench.ab_bench --stream --streams 8 --pair tiny                 # 8 requests at once
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import sys
import time
from dataclasses import dataclass

from bench.report import emit, machine, table, write_results
from bench.speculative_bench import load_prompts
from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.serving import pairs, server

HEAD = pairs.DEFAULT_PAIR_HEAD_NAME


@dataclass(frozen=True)
class Setting:
    label: str
    draft_model: str | None  # None: the server's default draft
    k: int | None  # num_draft_tokens (None: the server's default); 0: target-only
    adaptive: bool | None = None
    branches: int | None = None

    def params(self, max_tokens: int) -> GenerationParams:
        return GenerationParams(max_tokens=max_tokens, num_draft_tokens=self.k, draft_model=self.draft_model,
                                adaptive_draft=self.adaptive, num_draft_branches=self.branches)


SETTINGS = {
    "target-only": Setting("target-only", None, 0, False),
    "default": Setting("the server's default draft", None, None),
    "ngram": Setting("ngram, adaptive K<=16", tn.NGRAM, 16, True),
    "layer-skip": Setting("layer-skip draft, adaptive K<=4", "draft_model", 4, True, 1),
    # the servers' --skip-draft (SWIFT's self-draft: the target without some of its layers)
    "self-skip": Setting("self-draft skipping layers, adaptive K<=4", tn.DEFAULT_SKIP_DRAFT_NAME, 4, True, 1),
    "head-k1": Setting("EAGLE-3 head, K=1", HEAD, 1, False, 1),
    "head-k2": Setting("EAGLE-3 head, K=2", HEAD, 2, False, 1),
    "head-k3": Setting("EAGLE-3 head, K=3", HEAD, 3, False, 1),
    "head-adaptive": Setting("EAGLE-3 head, adaptive K<=6", HEAD, 6, True, 1),
    "head-tree": Setting(f"EAGLE-3 head, tree of {pairs.DEFAULT_PAIR_DRAFT_BRANCHES}, K=8", HEAD, 8, False,
                         pairs.DEFAULT_PAIR_DRAFT_BRANCHES),
}
DEFAULT_SETTINGS = "target-only,default,head-k3,head-adaptive"


def batches(plist: list[str], streams: int) -> list[list[str]]:
    """The prompts as sent: one at a time (streams 1), or `streams` at once, the set's prompts in turn (wrapping
    round when there are fewer)."""
    return [[plist[(i + j) % len(plist)] for j in range(streams)] for i in range(0, len(plist), streams)]


def run(clients: dict[str, list[Client]], prompts: dict[str, list[str]], settings: list[Setting], max_tokens: int,
        repeats: int, stream: bool = False) -> dict:
    """{(kind, label): {server: {tokens, seconds, rounds}, "equal": n, "requests": n}}; each batch of requests
    (as many at once as each server has clients) to both servers back to back, the first of them alternating;
    seconds: each batch's wall time."""
    names = list(clients)
    for pool in clients.values():  # warm every path (and each orchestrator's cost measurements)
        client = pool[0]
        for s in settings:
            client.generate(prompts["grounded"][0], s.params(16))
        # and every prompt once: each setting then finds its prompt's blocks in the prefix cache, not only the
        # settings after the first that sends it
        for plist in prompts.values():
            for prompt in plist:
                client.generate(prompt, settings[0].params(1))
    streams = len(clients[names[0]])
    results, turn = {}, 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=streams) as threads:
        for kind, plist in prompts.items():
            for s in settings:
                agg = {name: dict(tokens=0, seconds=0.0, rounds=0) for name in names}
                agg["equal"] = agg["requests"] = 0
                for _ in range(repeats):
                    for batch in batches(plist, streams):
                        order = names if turn % 2 == 0 else names[::-1]
                        turn += 1
                        texts = {}
                        for name in order:
                            start = time.perf_counter()
                            responses = list(threads.map(
                                lambda client, prompt: client.generate(prompt, s.params(max_tokens), stream=stream),
                                clients[name], batch))
                            agg[name]["seconds"] += time.perf_counter() - start
                            texts[name] = [response.text for response in responses]
                            agg[name]["tokens"] += sum(response.num_output_tokens for response in responses)
                            agg[name]["rounds"] += sum(response.num_rounds for response in responses)
                        agg["requests"] += len(batch)
                        agg["equal"] += sum(len(set(answers)) == 1 for answers in zip(*texts.values()))
                results[kind, s.label] = agg
                rates = "  ".join(f"{name} {agg[name]['tokens'] / agg[name]['seconds']:6.1f}" for name in names)
                print(f"  {kind:8s} {s.label:40s} tok/s {rates}", file=sys.stderr, flush=True)
    return results


def report(results: dict, settings: list[Setting], labels: dict[str, str], max_tokens: int, per_set: int,
           repeats: int, stream: bool = False, streams: int = 1) -> str:
    def rate(agg, name):
        return agg[name]["tokens"] / agg[name]["seconds"]

    lines = [f"{machine()}. Two servers at once, every request to both back to back (the first alternating), "
             f"{per_set} prompts per set x {repeats}, {max_tokens} tokens, greedy, "
             f"{'streamed (a response per round)' if stream else 'one response a request'}, "
             f"{'one request at a time' if streams == 1 else f'{streams} requests at once (tokens/s: all of theirs)'}.",
             "",
             f"- A: {labels['A']}", f"- B: {labels['B']}", ""]
    base_label = SETTINGS["target-only"].label
    for kind in dict.fromkeys(kind for kind, _ in results):
        rows = []
        for s in settings:
            agg = results[kind, s.label]
            base = results.get((kind, base_label))
            speedups = (["-", "-"] if base is None or s.label == base_label else
                        [f"{rate(agg, n) / rate(base, n):.2f}x" for n in ("A", "B")])
            rows.append([s.label, f"{rate(agg, 'A'):.1f}", f"{rate(agg, 'B'):.1f}",
                         f"{rate(agg, 'B') / rate(agg, 'A'):.2f}x", *speedups,
                         f"{agg['A']['tokens'] / agg['A']['rounds']:.2f} / {agg['B']['tokens'] / agg['B']['rounds']:.2f}",
                         f"{agg['equal']}/{agg['requests']}"])
        lines += [f"**{kind} prompts**", "",
                  table(rows, ["setting", "A tok/s", "B tok/s", "B / A", "A over its target-only",
                               "B over its target-only", "tokens per round A / B", "text A = B"]), ""]
    return "\n".join(lines)


def _env(pairs_: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for item in pairs_:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"an environment setting is KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-arg", action="append", default=[],
                            help=f"a launcher argument of server {side.upper()} (repeatable)")
        parser.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE",
                            help=f"an environment variable of server {side.upper()} (repeatable)")
        parser.add_argument(f"--{side}-url", help=f"gRPC host:port of a running server {side.upper()} instead")
    parser.add_argument("--pair", default="default", help="the launcher's --pair for the servers started here")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help=f"comma-separated, of {', '.join(SETTINGS)} (default {DEFAULT_SETTINGS})")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set (bench/prompts_*.jsonl)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--streams", type=int, default=1,
                        help="requests at once, each on a connection of its own (the set's prompts in turn)")
    parser.add_argument("--stream", action="store_true",
                        help="stream every request's responses (a response per round, as clients ask): what the "
                             "server does per response then counts")
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)
    unknown = [name for name in args.settings.split(",") if name not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    settings = [SETTINGS[name] for name in args.settings.split(",")]
    if args.streams < 1:
        parser.error(f"--streams must be at least 1, got {args.streams}")
    try:
        envs = {"A": _env(args.a_env), "B": _env(args.b_env)}
    except ValueError as exc:
        parser.error(str(exc))
    prompts = {kind: load_prompts(kind, args.prompts) for kind in ("grounded", "open")}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our servers
    owned, urls, labels = [], {}, {}
    cache = pairs.cache_dir()
    try:
        for name, url, extra, env in (("A", args.a_url, args.a_arg, args.a_env), ("B", args.b_url, args.b_arg, args.b_env)):
            if url:
                urls[name], labels[name] = url, f"the server at {url}"
                continue
            launcher = ["--pair", args.pair, *extra]
            print(f"starting server {name}: {' '.join(launcher)} {' '.join(env)}", file=sys.stderr, flush=True)
            own = server.start(cache / "run" / f"bench-ab-{name.lower()}", cache / f"bench-ab-{name.lower()}.log",
                               launcher, env=envs[name])
            owned.append(own)
            urls[name] = own.grpc_url
            labels[name] = f"`{' '.join([*env, 'python -m specdec.serving.launcher', *launcher])}`"
        clients = {name: [Client(url, "grpc", timeout_s=600) for _ in range(args.streams)]
                   for name, url in urls.items()}
        results = run(clients, prompts, settings, args.max_tokens, args.repeats, args.stream)
    finally:
        for own in owned:
            own.stop()
    text = report(results, settings, labels, args.max_tokens, args.prompts, args.repeats, args.stream, args.streams)
    emit(text, args.out)
    if args.results:
        write_results(args.results, "Two servers side by side: `make bench-ab`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
