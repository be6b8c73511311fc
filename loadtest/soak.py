"""Soak test (`make soak`): Locust against the default pair for a set time, with the server's memory.

It starts a default-pair server (or uses --grpc-url with --server-pid, the launcher's or tritonserver's
pid), runs Locust headless for a warm-up, records the resident memory of tritonserver and every Python
stub, runs Locust for --duration, records it again, and prints one table: requests, failures, output
tokens/s and the RSS at start (after warm-up) and end, per process and in total. Targets: no failure and
RSS growth under 5 % after warm-up.

    python loadtest/soak.py --duration 600 --users 8        # what `make soak` runs (SOAK_SECONDS, SOAK_USERS)
    python loadtest/soak.py --launcher-arg=--set=target_model.executor=static \
        --launcher-arg=--set=draft_model.executor=static      # the static executor's KV pool, on CPU eagerly
"""

from __future__ import annotations

import argparse
import csv
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
        cmd = proc.cmdline()
        if proc.name() == "tritonserver" or (cmd and cmd[0].endswith("/tritonserver")):
            out["tritonserver"] = proc
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
    return {name: proc.memory_info().rss / 2**20 for name, proc in sorted(processes.items())}


def rss_parts_mb(proc: psutil.Process) -> dict[str, float]:
    """RSS split as the kernel counts it: anonymous (heap: tensors, allocator caches) and shared memory
    (the Python backend's /dev/shm pool, which grows with concurrency and never shrinks)."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status"))
    return {part: int(fields[f"Rss{part.capitalize()}"].split()[0]) / 1024 for part in ("anon", "shmem")}


def sample_every(processes: dict[str, psutil.Process], seconds: float, stop: threading.Event) -> list[dict]:
    """RSS parts of every process every `seconds` until `stop` (in a thread while Locust runs)."""
    samples = []
    while True:
        samples.append({name: rss_parts_mb(proc) for name, proc in sorted(processes.items())})
        if stop.wait(seconds):
            return samples


def locust(grpc_url: str, seconds: float, users: int, csv_prefix: Path, max_tokens: int) -> dict:
    """Run Locust headless; returns its aggregated `generate` row and the summary it printed."""
    command = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "-u", str(users),
               "-r", str(users), "-t", f"{int(seconds)}s", "--stop-timeout", "60", "--host", grpc_url,
               "--csv", str(csv_prefix), "--max-tokens", str(max_tokens), "--only-summary"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 300)
    rows = list(csv.DictReader(open(f"{csv_prefix}_stats.csv")))
    (row,) = [r for r in rows if r["Name"] == "generate"]
    lines = (result.stdout + result.stderr).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("speculative decoding load summary")), None)
    summary = [] if start is None else lines[start + 1:start + 7]  # the locustfile's own summary
    return {"requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
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
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--launcher-arg", action="append", default=[],
                        help="more arguments for the server started here (repeatable)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    if args.launcher_arg and args.grpc_url is not None:
        parser.error("--launcher-arg applies to the server started here, not to --grpc-url's")
    own = None
    if args.grpc_url is None:
        cache = HERE.parent / ".cache"
        own = server.start(cache / "run" / "soak", cache / "soak-server.log", ["--pair", args.pair, *args.launcher_arg])
        args.grpc_url, args.server_pid = own.grpc_url, own.process.pid
    try:
        processes = server_processes(args.server_pid)
        work = Path(tempfile.mkdtemp(prefix="soak-"))
        warm = locust(args.grpc_url, args.warmup, args.users, work / "warmup", args.max_tokens)
        start = rss_mb(processes)
        started = time.monotonic()
        stop, samples = threading.Event(), []
        sampler = threading.Thread(target=lambda: samples.extend(sample_every(processes, args.sample_every, stop)))
        sampler.start()
        run = locust(args.grpc_url, args.duration, args.users, work / "soak", args.max_tokens)
        stop.set()
        sampler.join()
        elapsed = time.monotonic() - started
        end = rss_mb(processes)
    finally:
        if own is not None:
            own.stop()
    first, last = samples[0], samples[-1]

    def parts(name: str) -> str:
        return " / ".join(f"{last[name][part] - first[name][part]:+.0f}" for part in ("anon", "shmem"))

    rows = [[name, f"{start[name]:.0f}", f"{end[name]:.0f}", f"{(end[name] / start[name] - 1) * 100:+.1f} %",
             parts(name)] for name in start]
    total_start, total_end = sum(start.values()), sum(end.values())
    rows.append(["total", f"{total_start:.0f}", f"{total_end:.0f}", f"{(total_end / total_start - 1) * 100:+.1f} %", ""])
    # Whether the largest grower levels off or keeps climbing: its RSS at each sample.
    grower = max(start, key=lambda name: end[name] - start[name])
    series = ", ".join(f"{sum(sample[grower].values()):.0f}" for sample in samples)
    settings = f" ({' '.join(args.launcher_arg)})" if args.launcher_arg else ""
    text = "\n".join([
        f"soak: {args.pair} pair{settings}, {args.users} users, {args.max_tokens} tokens per request, "
        f"{args.warmup:.0f} s warm-up ({warm['requests']} requests, {warm['failures']} failures), "
        f"then {elapsed:.0f} s: {run['requests']} requests, {run['failures']} failures",
        *run["summary"], "",
        tabulate(rows, ["process", "RSS after warm-up (MiB)", "RSS at end (MiB)", "growth",
                        "anonymous / shared growth (MiB)"], tablefmt="github", disable_numparse=True), "",
        f"{grower} RSS (anonymous + shared, MiB) every {args.sample_every:.0f} s: {series}"])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    growth = (total_end / total_start - 1) * 100
    return 0 if run["failures"] == 0 and warm["failures"] == 0 and run["code"] == 0 and growth < 5 else 1


if __name__ == "__main__":
    sys.exit(main())
