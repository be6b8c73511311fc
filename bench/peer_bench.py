"""This server beside llama.cpp's `llama-server`, the engine CPU users pick (`make bench-peer`).

Both serve the default pair's own GGUF file (SmolLM2-135M-Instruct, Q4_1: the same weights, each engine
on its own kernels) through their OpenAI APIs, and every configuration runs at once: this server (one, its
drafts chosen per request) and one `llama-server` per llama.cpp configuration (its draft is a server flag),
each on its own port. Every chat request goes to each configuration back to back, the order rotating from
prompt to prompt, so all see the same moments of this noisy machine. Streamed, greedy, one request at a time,
the benchmark's grounded and open-ended prompts (bench/prompts_*.jsonl) as chats (each engine applies the
GGUF's chat template; the prompt's token count is compared), each prompt sent to each configuration once
before the timed requests (both engines keep prompts' prefixes cached: TTFT is a cached prompt's). Per
configuration: tokens/s, its speedup over its own engine's target-only row and over llama.cpp's, mean time
to first token, the acceptance of drafted tokens (both engines report them), tokens per round (this server's),
and how many answers equal its engine's target-only answer (greedy speculation must not change it) and this
server's target-only answer (the engines' different kernels may round a near tie either way).

llama.cpp's configurations: target-only; its n-gram draft (`--spec-type ngram-simple`, an n-gram of
`--llama-ngram` tokens); a draft model (`--spec-type draft-simple` with `--llama-draft`: a GGUF of the
target's first layers, this server's layer-skip draft, written by `--write-draft-gguf PATH`); the EAGLE-3
head (`--spec-type draft-eagle3` with `--llama-eagle3`: the default pair's head converted by llama.cpp's
`convert_hf_to_gguf.py --target-model-dir`). Each draft's row only where its file is given. Measured:
docs/results/2026-12-06-cpu-llama-cpp.md.

    python -m bench.peer_bench --llama-server /path/to/llama-server --write-draft-gguf /tmp/draft10.gguf
    python -m bench.peer_bench --llama-server /path/to/llama-server --llama-draft /tmp/draft10.gguf \
        --llama-eagle3 /tmp/eagle3.gguf --results cpu-llama-cpp
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai

from bench.report import emit, machine, table, write_results
from bench.speculative_bench import load_prompts
from specdec import tensor_names as tn
from specdec.gateway.protocol import STATS_FIELD
from specdec.serving import pairs, server

OURS, LLAMA = "this server", "llama.cpp"


@dataclass(frozen=True, eq=False)  # hashed as itself: a row of the run
class Config:
    engine: str  # OURS or LLAMA
    key: str  # what --only names
    label: str
    extra_body: dict = field(default_factory=dict)  # ours: the request's draft settings
    server_args: tuple[str, ...] = ()  # llama.cpp: its server's speculative flags


def our_configs() -> list[Config]:
    """This server's rows: target-only, and each draft of the default pair (the server's default first)."""
    head = pairs.DEFAULT_PAIR_HEAD_NAME
    both = f"{tn.NGRAM}{tn.DRAFT_SEPARATOR}{head}"
    return [Config(OURS, "target-only", "target-only", {"num_draft_tokens": 0}),
            Config(OURS, tn.NGRAM, f"{tn.NGRAM} (the default)", {"draft_model": tn.NGRAM}),
            Config(OURS, both, both, {"draft_model": both}),
            Config(OURS, head, f"{head} (hosted head)", {"draft_model": head}),
            Config(OURS, "draft_model", "draft_model (first 10 layers)", {"draft_model": "draft_model"})]


def llama_configs(draft: str | None, eagle3: str | None, ngram: int, k: int) -> list[Config]:
    """llama.cpp's rows: target-only, its n-gram draft (an n-gram of `ngram` tokens, `k` drafted), and the
    draft model and EAGLE-3 head where given (`k` drafted)."""
    rows = [Config(LLAMA, "llama-target-only", "target-only"),
            Config(LLAMA, "llama-ngram", f"ngram-simple (n {ngram}, m {k})",
                   server_args=("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(ngram),
                                "--spec-ngram-simple-size-m", str(k)))]
    if draft:
        rows.append(Config(LLAMA, "llama-draft", f"draft-simple ({Path(draft).name}, n_max {k})",
                           server_args=("--spec-type", "draft-simple", "--spec-draft-model", draft,
                                        "--spec-draft-n-max", str(k))))
    if eagle3:
        rows.append(Config(LLAMA, "llama-eagle3", f"draft-eagle3 ({Path(eagle3).name}, n_max {k})",
                           server_args=("--spec-type", "draft-eagle3", "--spec-draft-model", eagle3,
                                        "--spec-draft-n-max", str(k))))
    return rows


def start_llama(binary: str, gguf: Path, config: Config, port: int, threads: int, log: Path) -> subprocess.Popen:
    command = [binary, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--jinja",
               "--threads", str(threads), "--threads-batch", str(threads), "--parallel", "1", "--ctx-size", "4096",
               "--no-webui", *config.server_args]
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def wait_llama(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}; its log {log}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server on port {port} not healthy in {timeout_s:g} s; its log {log}")


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    tokens: int
    seconds: float
    ttft: float
    drafted: int | None  # None: the engine did not say
    accepted: int | None
    rounds: int | None


def ask(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, extra_body: dict) -> Answer:
    """One streamed greedy chat; its usage and drafts from the last chunks (ours: the `speculative_decoding`
    object; llama.cpp: `timings`' draft_n and draft_n_accepted)."""
    started = time.perf_counter()
    first, parts, usage, extra = None, [], None, {}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() if first is None else first
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        extra.update(chunk.model_extra or {})
    seconds = time.perf_counter() - started
    ours, timings = extra.get(STATS_FIELD) or {}, extra.get("timings") or {}
    if ours:
        drafted, accepted, rounds = (ours.get(tn.TOTAL_DRAFT_TOKENS), ours.get(tn.TOTAL_ACCEPTED_DRAFT_TOKENS),
                                     ours.get(tn.NUM_ROUNDS))
    else:
        drafted, accepted, rounds = timings.get("draft_n"), timings.get("draft_n_accepted"), None
    return Answer("".join(parts), usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0,
                  seconds, (first or time.perf_counter()) - started, drafted, accepted, rounds)


def run(clients: dict[Config, tuple[openai.OpenAI, str]], prompts: dict[str, list[str]], max_tokens: int,
        repeats: int) -> dict:
    """{(kind, config): [Answer per request]}, every prompt to every configuration back to back, the order
    rotating; and {(kind, prompt index, config)}'s texts for the equality counts."""
    configs = list(clients)
    for config, (client, model) in clients.items():  # warm every path (and each prompt's prefix)
        for plist in prompts.values():
            for prompt in plist:
                ask(client, model, prompt, 4, config.extra_body)
    answers: dict = {}
    turn = 0
    for kind, plist in prompts.items():
        for _ in range(repeats):
            for index, prompt in enumerate(plist):
                order = configs[turn % len(configs):] + configs[:turn % len(configs)]
                turn += 1
                for config in order:
                    client, model = clients[config]
                    answer = ask(client, model, prompt, max_tokens, config.extra_body)
                    answers.setdefault((kind, config), []).append((index, answer))
        for config in configs:
            got = answers[kind, config]
            rate = sum(a.tokens for _, a in got) / sum(a.seconds for _, a in got)
            print(f"  {kind:8s} {config.engine:12s} {config.label:44s} {rate:6.1f} tok/s", file=sys.stderr,
                  flush=True)
    return answers


def report(answers: dict, configs: list[Config], header: str) -> str:
    lines = [header, ""]
    for kind in dict.fromkeys(kind for kind, _ in answers):
        rows = []
        base = {engine: next(c for c in configs if c.engine == engine and c.label == "target-only")
                for engine in (OURS, LLAMA)}
        texts = {config: {i: a.text for i, a in answers[kind, config]} for config in configs}

        def rate(config):
            got = [a for _, a in answers[kind, config]]
            return sum(a.tokens for a in got) / sum(a.seconds for a in got)

        for config in configs:
            got = [a for _, a in answers[kind, config]]
            told = [a for a in got if a.drafted is not None]
            drafted = sum(a.drafted for a in told)
            acceptance = f"{sum(a.accepted for a in told) / drafted:.2f} of {drafted}" if drafted else "-"
            per_round = (f"{sum(a.tokens for a in told) / sum(a.rounds for a in told):.2f}"
                         if told and all(a.rounds for a in told) and config is not base[config.engine] else "-")
            own = base[config.engine]
            same_own = sum(texts[config][i] == texts[own][i] for i in texts[config])
            same_ours = sum(texts[config][i] == texts[base[OURS]][i] for i in texts[config])
            rows.append([config.engine, config.label, f"{rate(config):.1f}",
                         "-" if config is own else f"{rate(config) / rate(own):.2f}x",
                         f"{rate(config) / rate(base[LLAMA]):.2f}x",
                         f"{1e3 * sum(a.ttft for a in got) / len(got):.0f}", acceptance, per_round,
                         f"{same_own}/{len(texts[config])}", f"{same_ours}/{len(texts[config])}",
                         f"{sum(a.prompt_tokens for a in got) / len(got):.1f}"])
        lines += [f"**{kind} prompts**", "",
                  table(rows, ["engine", "configuration", "tokens/s", "over its engine's target-only",
                               "over llama.cpp's target-only", "mean TTFT (ms)", "acceptance of drafted tokens",
                               "tokens per round", "text = its target-only", "text = ours target-only",
                               "mean prompt tokens"]), ""]
    return "\n".join(lines)


def write_draft_gguf(source: Path, out: Path, layers: int) -> None:
    """The target's first `layers` layers as a GGUF of their own (the same blocks, every other field
    kept): llama.cpp's draft-simple draft of the same weights as this server's layer-skip draft."""
    import gguf  # llama.cpp's gguf-py (`pip install gguf`), only for this

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, item in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else item.contents()
        if item.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, item.types[0], sub_type=item.types[-1])
        else:
            writer.add_key_value(name, value, item.types[0])
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default=shutil.which("llama-server"),
                        help="llama.cpp's llama-server binary (default: the one on PATH)")
    parser.add_argument("--llama-draft", help="a GGUF draft model for llama.cpp's draft-simple row")
    parser.add_argument("--llama-eagle3",
                        help="the default pair's EAGLE-3 head as a GGUF, llama.cpp's draft-eagle3 row")
    parser.add_argument("--write-draft-gguf", metavar="PATH",
                        help=f"write the target's first {pairs.DEFAULT_DRAFT_LAYERS} layers as a GGUF and exit")
    parser.add_argument("--llama-ngram", type=int, default=tn.LOOKUP_NGRAM[0],
                        help="llama.cpp's n-gram length (its ngram-simple size n; this server's prompt lookup tries "
                             f"{tn.LOOKUP_NGRAM[1]} down to {tn.LOOKUP_NGRAM[0]})")
    parser.add_argument("--k", type=int, default=4, help="llama.cpp's draft length (its n_max, its n-gram's m)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's threads")
    parser.add_argument("--only", help="comma-separated configurations to run (target-only, ngram, ..., "
                                       "llama-target-only, llama-ngram, llama-draft, llama-eagle3; both "
                                       "target-only rows always)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set (bench/prompts_*.jsonl)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)
    gguf_path = pairs.smollm2_gguf_path()
    if args.write_draft_gguf:
        write_draft_gguf(gguf_path, Path(args.write_draft_gguf), pairs.DEFAULT_DRAFT_LAYERS)
        print(f"wrote {args.write_draft_gguf}", file=sys.stderr)
        return 0
    if not args.llama_server or not Path(args.llama_server).is_file():
        parser.error("--llama-server: llama.cpp's llama-server binary is needed (none on PATH)")
    for name in ("llama_draft", "llama_eagle3"):
        if getattr(args, name) and not Path(getattr(args, name)).is_file():
            parser.error(f"--{name.replace('_', '-')}: no such file {getattr(args, name)}")
    configs = our_configs() + llama_configs(args.llama_draft, args.llama_eagle3, args.llama_ngram, args.k)
    if args.only:
        keys = args.only.split(",")
        unknown = [key for key in keys if key not in {c.key for c in configs}]
        if unknown or not {"target-only", "llama-target-only"} <= set(keys):
            parser.error(f"--only: choose from {[c.key for c in configs]}, both target-only rows included"
                         + (f" (unknown: {unknown})" if unknown else ""))
        configs = [c for c in configs if c.key in keys]
    prompts = {kind: load_prompts(kind, args.prompts) for kind in ("grounded", "open")}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the servers
    cache = pairs.cache_dir()
    ours, llamas, clients = None, [], {}
    try:
        print("starting this server (--pair default)", file=sys.stderr, flush=True)
        ours = server.start(cache / "run" / "bench-peer", cache / "bench-peer-server.log", ["--pair", "default"])
        client = openai.OpenAI(base_url=ours.openai_url, api_key="none", timeout=600)
        model = client.models.list().data[0].id
        for config in configs:
            if config.engine == OURS:
                clients[config] = (client, model)
        ports = server.free_ports(len(configs))
        for config, port in zip((c for c in configs if c.engine == LLAMA), ports):
            log = cache / f"bench-peer-llama-{port}.log"
            print(f"starting llama-server: {config.label}", file=sys.stderr, flush=True)
            process = start_llama(args.llama_server, gguf_path, config, port, args.threads, log)
            llamas.append(process)
            wait_llama(port, process, log)
            clients[config] = (openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600),
                               "default")
        answers = run(clients, prompts, args.max_tokens, args.repeats)
    finally:
        for process in llamas:
            process.terminate()
        for process in llamas:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        if ours is not None:
            ours.stop()
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True).stderr.strip()
    header = (f"{machine()}; llama.cpp {version.splitlines()[0] if version else '(version unknown)'}, "
              f"{args.threads} threads. The same GGUF ({gguf_path.name}) served by both, every configuration "
              f"at once, each chat to each configuration back to back (the order rotating), {args.prompts} prompts "
              f"per set x {args.repeats}, at most {args.max_tokens} tokens, greedy, streamed, one at a time.")
    text = report(answers, configs, header)
    emit(text, args.out)
    if args.results:
        write_results(args.results, "This server beside llama.cpp's llama-server: `make bench-peer`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
