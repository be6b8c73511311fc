"""Soak test (`make soak`): Locust against the default pair for a set time, with the server's memory.

It starts a default-pair server (or uses --grpc-url with --server-pid, the launcher's or tritonserver's
pid), runs Locust headless for a warm-up, records the resident memory of tritonserver and every Python
stub, runs Locust for --duration, records it again, and prints one table: requests, failures, output
tokens/s and the RSS at start (after warm-up) and end, per process and in total. Targets: no failure and
RSS growth under 5 % after warm-up.

    python loadtest/soak.py --duration 600 --users 8        # what `make soak` runs (SOAK_SECONDS, SOAK_USERS)
    python loadtest/soak.py --launcher-arg=--set=target_model.executor=static \
        --launcher-arg=--set=draft_model.executor=static      # the static executor's KV pool, on CPU eagerly
    python loadtest/soak.py --mix --kill target_model --duration 1800   # `make soak-mixed`

--mix sends mixed traffic (the locustfile's MIX: streamed and not, greedy and seeded sampling, penalties,
clients that cancel mid-stream, structured output on 15 %, 20 % sent to vllm_compatible as the clients of
Triton's vLLM backend send them, and --openai-fraction (20 % with --mix) as chat completions through the
OpenAI API the launcher runs, mixed alike: its own process's memory is a row of the table); --kill MODEL
SIGKILLs that model's first stub halfway through the run, as the OOM killer would: the launcher's watchdog
brings it back, and the failures of the requests it was serving (the server's "being restored, retry", or a
dropped stream when the server restarts) are counted apart as expected; any other failure is unexpected.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from tabulate import tabulate

from specdec.serving import server

HERE = Path(__file__).resolve().parent


def server_processes(pid: int) -> dict[str, psutil.Process]:
    """tritonserver and its stubs under the process `pid` (the launcher or tritonserver), by a readable name."""
    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd, short = proc.cmdline(), proc.name()
        except psutil.Error:
            # Gone (a short-lived child: a library's helper run by a stub), or a zombie (a killed stub its
            # server has not reaped yet).
            continue
        if short == "tritonserver" or (cmd and cmd[0].endswith("/tritonserver")):
            out["tritonserver"] = proc
        elif "specdec.gateway" in cmd:  # the OpenAI API the launcher runs beside the server
            out["openai api"] = proc
        elif cmd and "triton_python_backend_stub" in cmd[0]:
            # The stub's arguments: its model repository path ends in <model>/<version>/model.py.
            model = next((Path(a).parts[-3] for a in cmd if a.endswith("model.py")), f"stub {proc.pid}")
            # A model with several instances (the orchestrator's two) has a stub each: number them.
            name, n = model, 1
            while name in out:
                n += 1
                name = f"{model} #{n}"
            out[name] = proc
    return out


def rss_mb(processes: dict[str, psutil.Process]) -> dict[str, float]:
    """RSS per process, leaving out one that ended since it was found."""
    out = {}
    for name, proc in sorted(processes.items()):
        try:
            out[name] = proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


# A request that failed because a model was down or being restored (see the module's docstring).
EXPECTED_WHEN_KILLED = ("being restored", "is not healthy", "not ready", "unavailable", "connect", "socket closed",
                        "stream removed", "no available versions")


def failures_by_kind(csv_prefix: Path, killed: bool) -> tuple[int, int, list[str]]:
    """(expected, unexpected, the unexpected errors' texts) from Locust's failures table."""
    expected, unexpected, texts = 0, 0, []
    path = Path(f"{csv_prefix}_failures.csv")
    for row in (csv.DictReader(open(path)) if path.exists() else []):
        count = int(row["Occurrences"])
        if killed and any(marker in row["Error"].lower() for marker in EXPECTED_WHEN_KILLED):
            expected += count
        else:
            unexpected += count
            texts.append(f"{count} x {row['Error'][:200]}")
    return expected, unexpected, texts


def kill_stub(server_pid: int, model: str) -> int:
    """SIGKILL the first stub of `model` under the server; its pid."""
    stub = server_processes(server_pid)[model]
    os.kill(stub.pid, signal.SIGKILL)
    return stub.pid


def rss_parts_mb(proc: psutil.Process) -> dict[str, float]:
    """RSS split as the kernel counts it: anonymous (heap: tensors, allocator caches) and shared memory
    (the Python backend's /dev/shm pool, which grows with concurrency and never shrinks)."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status"))
    return {part: int(fields[f"Rss{part.capitalize()}"].split()[0]) / 1024 for part in ("anon", "shmem")}


def sample_every(server_pid: int, seconds: float, stop: threading.Event) -> list[dict]:
    """RSS parts of every process every `seconds` until `stop` (in a thread while Locust runs); the
    processes are looked up at each sample (a killed stub is replaced by a new one of the same name)."""
    samples = []
    while True:
        try:
            samples.append({name: rss_parts_mb(proc) for name, proc in sorted(server_processes(server_pid).items())})
        except (psutil.Error, OSError, KeyError):
            # A stub died between the lookup and the reading (an exiting process's status has no Rss lines
            # once its memory is released): the next sample has its successor.
            pass
        if stop.wait(seconds):
            return samples


def locust(grpc_url: str, seconds: float, users: int, csv_prefix: Path, max_tokens: int, mix: bool = False,
           openai_url: str = "", openai_fraction: float = 0.0) -> dict:
    """Run Locust headless; returns its `generate` rows' counts (summed over the kinds) and the summary it printed."""
    command = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "-u", str(users),
               "-r", str(users), "-t", f"{int(seconds)}s", "--stop-timeout", "60", "--host", grpc_url,
               "--csv", str(csv_prefix), "--max-tokens", str(max_tokens), "--only-summary"]
    if mix:
        command += ["--mix", "--guided-fraction", "0.15", "--vllm-fraction", "0.2"]
    if openai_fraction:
        command += ["--openai-fraction", str(openai_fraction), "--openai-url", openai_url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 300)
    rows = list(csv.DictReader(open(f"{csv_prefix}_stats.csv")))
    generate = [r for r in rows if r["Name"] == "generate"]  # one per kind: ensemble's ("grpc"), "vllm", "openai"
    lines = (result.stdout + result.stderr).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("speculative decoding load summary")), None)
    summary = [] if start is None else lines[start + 1:start + 7]  # the locustfile's own summary
    return {"requests": sum(int(r["Request Count"]) for r in generate),
            "failures": sum(int(r["Failure Count"]) for r in generate),
            "kinds": ", ".join(f"{r['Type']} {r['Request Count']}" for r in generate),
            "code": result.returncode, "summary": summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600, help="seconds of load after the warm-up")
    parser.add_argument("--warmup", type=float, default=300,
                        help="seconds of load before the first memory reading (the target levels off in ~5 min)")
    parser.add_argument("--sample-every", type=float, default=60, help="seconds between memory samples")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pair", default="default")
    parser.add_argument("--grpc-url", help="a running server instead of one started here (with --server-pid)")
    parser.add_argument("--openai-url", help="its OpenAI API's base URL (http://host:9000/v1), for --openai-fraction")
    parser.add_argument("--openai-fraction", type=float,
                        help="the share of requests sent through the OpenAI API (default: 0.2 with --mix, else 0)")
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--launcher-arg", action="append", default=[],
                        help="more arguments for the server started here (repeatable)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--mix", action="store_true", help="mixed traffic (see the module's docstring)")
    parser.add_argument("--kill", metavar="MODEL", help="SIGKILL this model's first stub halfway through the run")
    args = parser.parse_args(argv)
    if args.launcher_arg and args.grpc_url is not None:
        parser.error("--launcher-arg applies to the server started here, not to --grpc-url's")
    if args.openai_fraction is None:
        args.openai_fraction = 0.2 if args.mix else 0.0
    if args.openai_fraction and args.grpc_url is not None and not args.openai_url:
        parser.error("--openai-fraction with --grpc-url needs --openai-url (the running server's OpenAI API)")
    own = None
    served = f"the server at {args.grpc_url}" if args.grpc_url else f"{args.pair} pair"  # (a running one's: unknown)
    if args.grpc_url is None:
        cache = HERE.parent / ".cache"
        own = server.start(cache / "run" / "soak", cache / "soak-server.log", ["--pair", args.pair, *args.launcher_arg])
        args.grpc_url, args.server_pid, args.openai_url = own.grpc_url, own.process.pid, own.openai_url
    work = Path(tempfile.mkdtemp(prefix="soak-"))  # Locust's CSVs, read here (the failures' texts are printed)
    try:
        traffic = dict(mix=args.mix, openai_url=args.openai_url, openai_fraction=args.openai_fraction)
        warm = locust(args.grpc_url, args.warmup, args.users, work / "warmup", args.max_tokens, **traffic)
        start = rss_mb(server_processes(args.server_pid))
        started = time.monotonic()
        stop, samples, killed = threading.Event(), [], []
        sampler = threading.Thread(target=lambda: samples.extend(sample_every(args.server_pid, args.sample_every, stop)))
        sampler.start()
        if args.kill:
            killer = threading.Timer(args.duration / 2, lambda: killed.append(kill_stub(args.server_pid, args.kill)))
            killer.start()
        run = locust(args.grpc_url, args.duration, args.users, work / "soak", args.max_tokens, **traffic)
        stop.set()
        sampler.join()
        elapsed = time.monotonic() - started
        end = rss_mb(server_processes(args.server_pid))
        expected, unexpected, unexpected_texts = failures_by_kind(work / "soak", bool(killed))
        _, warm_unexpected, warm_texts = failures_by_kind(work / "warmup", False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own is not None:
            own.stop()
    if not samples:
        raise SystemExit("soak: no memory sample could be read (the server's processes were gone)")
    first, last = samples[0], samples[-1]

    def parts(name: str) -> str:
        return " / ".join(f"{last[name][part] - first[name][part]:+.0f}" for part in ("anon", "shmem"))

    rows = [[name, f"{start[name]:.0f}", f"{end[name]:.0f}", f"{(end[name] / start[name] - 1) * 100:+.1f} %",
             parts(name) if name in first and name in last else ""] for name in start if name in end]
    total_start, total_end = sum(start.values()), sum(end.values())
    rows.append(["total", f"{total_start:.0f}", f"{total_end:.0f}", f"{(total_end / total_start - 1) * 100:+.1f} %", ""])
    # Whether the largest grower levels off or keeps climbing: its RSS at each sample.
    grower = max((name for name in start if name in end), key=lambda name: end[name] - start[name])
    series = ", ".join(f"{sum(sample[grower].values()):.0f}" for sample in samples if grower in sample)
    settings = f" ({' '.join(args.launcher_arg)})" if args.launcher_arg else ""
    traffic = (" mixed traffic," if args.mix else "") + \
        (f" {args.openai_fraction:.0%} through the OpenAI API," if args.openai_fraction else "")
    kill = (f" {args.kill}'s stub (pid {killed[0]}) SIGKILLed at {args.duration / 2:.0f} s: {expected} expected "
            f"failures;" if killed else "")
    text = "\n".join([
        f"soak: {served}{settings},{traffic} {args.users} users, {args.max_tokens} tokens per request, "
        f"{args.warmup:.0f} s warm-up ({warm['requests']} requests, {warm['failures']} failures), "
        f"then {elapsed:.0f} s: {run['requests']} requests ({run['kinds']});{kill} {unexpected} unexpected failures",
        *[f"  unexpected: {t}" for t in unexpected_texts + warm_texts],
        *run["summary"], "",
        tabulate(rows, ["process", "RSS after warm-up (MiB)", "RSS at end (MiB)", "growth",
                        "anonymous / shared growth (MiB)"], tablefmt="github", disable_numparse=True), "",
        f"{grower} RSS (anonymous + shared, MiB) every {args.sample_every:.0f} s: {series}"])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    growth = (total_end / total_start - 1) * 100
    ok = unexpected == 0 and warm_unexpected == 0 and (run["code"] == 0 or (killed and expected)) and growth < 5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
