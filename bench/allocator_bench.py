"""The launcher's `--allocator`: glibc's malloc against TCMalloc, two servers of one pair side by side
(`make bench-allocator`).

Both servers run at once (their models loaded, so they start alike); the same mixed load (prompts of 20 to
1200 words of this repository's docs, --concurrency streams at a time, streamed) goes to one, then the
other, then new prompts (none in the prefix cache) in the other order, so that each sees the machine's
drift alike. Per server: each pass's wall time, its mean time to the first text, output tokens per second;
and its stubs' resident memory (RSS, MB) once loaded, after the last pass, and after an idle wait long
enough for the models' heap trim (`heap_trim_interval_s`, 30 s by default). The texts must be equal
(greedy), so the count of equal texts is reported.

    python -m bench.allocator_bench                      # the default pair, 2 passes each
    python -m bench.allocator_bench --pair tiny --passes 1 --idle-s 0 --max-words 400
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report import emit, machine, table, write_results
from client import Client, GenerationParams
from specdec.serving import allocator, pairs, server

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS = (20, 400, 60, 900, 150, 1200, 30, 700)  # the prompts' lengths, in words, repeated --repeats times
SIDES = (allocator.GLIBC, allocator.TCMALLOC)


def prompts(repeats: int, max_words: int = max(WORDS), offset: int = 0) -> list[str]:
    """Slices of the docs' text, each from its own place, of the WORDS lengths (at most max_words); another
    `offset` (a pass's number) takes other places: a pass finds none of an earlier pass's prompts in the
    prefix cache."""
    words = " ".join(path.read_text() for path in sorted((REPO_ROOT / "docs").glob("*.md"))).split()
    out = []
    for i, n in enumerate(WORDS * repeats):
        n = min(n, max_words)
        start = (i * 997 + offset * 7919) % max(1, len(words) - n)
        out.append(" ".join(words[start:start + n]))
    return out


def stub_rss_mb(run_dir: Path) -> dict[str, int]:
    """Each model's stub's resident memory in MB (by the model directory in its arguments)."""
    out = subprocess.run(["ps", "-ww", "-eo", "rss,args"], capture_output=True, text=True).stdout
    found: dict[str, int] = {}
    for line in out.splitlines():
        rss, _, args = line.strip().partition(" ")
        if "triton_python_backend_stub" not in args or str(run_dir) not in args:
            continue
        model = Path(args.split()[1]).parent.parent.name  # stub MODEL_DIR/VERSION/model.py ...
        found[model] = found.get(model, 0) + int(rss) // 1024
    return found


def one_pass(client: Client, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    """The load once: its wall time, each request's time to its first text, the output tokens, the texts."""
    def request(prompt: str) -> tuple[float, int, str]:
        start, first = time.perf_counter(), []
        result = client.generate(prompt, GenerationParams(max_tokens=max_tokens), stream=True,
                                 on_text=lambda _: first or first.append(time.perf_counter()))
        return (first[0] if first else time.perf_counter()) - start, result.num_output_tokens, result.text

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(request, texts))
    wall = time.perf_counter() - start
    return {"wall": wall, "ttft": statistics.mean(d[0] for d in done), "tokens": sum(d[1] for d in done),
            "texts": [d[2] for d in done]}


def report(results: dict, rss: dict, labels: dict, args, count: int) -> str:
    lines = [f"{machine()}. Two servers at once, `--pair {args.pair}`; {count} prompts of "
             f"{min(WORDS)}-{args.max_words} words (the docs' text), {args.concurrency} streams at a time, "
             f"{args.max_tokens} tokens each, greedy, "
             f"streamed; the passes alternate ({args.passes} per server, each its own prompts).", ""]
    lines += [f"- {side}: `python -m specdec.serving.launcher {labels[side]}`" for side in SIDES] + [""]
    rows = []
    for side in SIDES:
        passes = results[side]
        rows.append([side, " / ".join(f"{p['wall']:.1f}" for p in passes),
                     f"{statistics.mean(p['wall'] for p in passes):.1f}",
                     f"{statistics.mean(p['ttft'] for p in passes) * 1000:.0f}",
                     f"{sum(p['tokens'] for p in passes) / sum(p['wall'] for p in passes):.1f}"])
    base, other = (statistics.mean(p["wall"] for p in results[side]) for side in SIDES)
    equal = sum(a == b for p, q in zip(results[SIDES[0]], results[SIDES[1]]) for a, b in zip(p["texts"], q["texts"]))
    lines += [table(rows, ["allocator", "wall per pass (s)", "mean wall (s)", "mean TTFT (ms)", "output tok/s"]), "",
              f"glibc's wall over TCMalloc's: **{base / other:.2f}x**; texts equal: {equal}/{count * args.passes}.", ""]
    models = sorted({model for side in SIDES for stage in rss[side].values() for model in stage})
    rows = [[side, stage, *(str(rss[side][stage].get(model, "-")) for model in models),
             str(sum(rss[side][stage].values()))] for side in SIDES for stage in rss[side]]
    lines += ["Stubs' resident memory (MB):", "", table(rows, ["allocator", "when", *models, "total"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default", help="the launcher's --pair")
    parser.add_argument("--passes", type=int, default=2, help="passes of the load per server, alternating")
    parser.add_argument("--repeats", type=int, default=2, help="times the 8 prompt lengths are sent per pass")
    parser.add_argument("--max-words", type=int, default=max(WORDS), help="longest prompt (the tiny pair: 400)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--idle-s", type=float, default=40.0,
                        help="idle wait before the last memory reading (the models' heap trim runs every 30 s)")
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)
    if not allocator.find_tcmalloc():
        parser.error(f"no TCMalloc library installed ({allocator.INSTALL_HINT})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our servers
    cache, owned = pairs.cache_dir(), {}
    labels = {side: f"--pair {args.pair} --allocator {side}" for side in SIDES}
    results: dict = {side: [] for side in SIDES}
    rss: dict = {side: {} for side in SIDES}
    try:
        for side in SIDES:
            print(f"starting the {side} server", file=sys.stderr, flush=True)
            owned[side] = server.start(cache / "run" / f"bench-allocator-{side}", cache / f"bench-allocator-{side}.log",
                                       labels[side].split())
        for side in SIDES:
            rss[side]["loaded"] = stub_rss_mb(owned[side].run_dir)
        clients = {side: Client(owned[side].grpc_url, "grpc", timeout_s=900) for side in SIDES}
        for i in range(args.passes):
            texts = prompts(args.repeats, args.max_words, offset=i)  # the same for both servers
            for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
                results[side].append(one_pass(clients[side], texts, args.concurrency, args.max_tokens))
                print(f"  {side} pass {i + 1}: {results[side][-1]['wall']:.1f} s", file=sys.stderr, flush=True)
        for side in SIDES:
            rss[side]["after the load"] = stub_rss_mb(owned[side].run_dir)
        if args.idle_s:
            time.sleep(args.idle_s)
            for side in SIDES:
                rss[side][f"{args.idle_s:.0f} s idle"] = stub_rss_mb(owned[side].run_dir)
    finally:
        for own in owned.values():
            own.stop()
    text = report(results, rss, labels, args, len(WORDS) * args.repeats)
    emit(text, args.out)
    if args.results:
        write_results(args.results, "glibc's malloc against TCMalloc: `make bench-allocator`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
