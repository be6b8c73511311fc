"""Start a real tritonserver on our model repository: `python -m specdec.launcher` (what `make serve` runs).

It finds the server binary shipped in the `nvidia-pytriton` wheel, assembles a backend directory with
the Python-backend stub built for the running interpreter, sets the library path the stub needs
(the interpreter's libpython first, then the wheel's bundled libraries), prepares the model pair,
renders the model repository for it and runs tritonserver in the foreground. SIGTERM/SIGINT stop the
server, which stops every stub process.

Environment: PAIR (tiny | default), HTTP_PORT, GRPC_PORT, METRICS_PORT (8000/8001/8002).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specdec import pairs, repository
from specdec.pairs import log


@dataclass(frozen=True)
class ServerLayout:
    binary: Path
    backend_dir: Path
    ld_library_path: str


def triton_layout(work_dir: Path) -> ServerLayout:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("nvidia-pytriton is not installed (run `make setup`)")
    pkg = Path(spec.origin).parent
    server = pkg / "tritonserver"
    binary = server / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise FileNotFoundError(f"no Python backend stub for Python {version} in {stub.parent.parent}")
    backend = work_dir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for src in (server / "backends" / "python" / "libtriton_python.so",
                server / "backends" / "python" / "triton_python_backend_utils.py", stub):
        # Copy then rename: replacing a stub binary that an older server still runs is allowed,
        # overwriting it in place is not ("Text file busy").
        staging = backend / f".{src.name}.new"
        shutil.copy2(src, staging)
        os.replace(staging, backend / src.name)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(pkg.parent / "nvidia_pytriton.libs")]
    existing = os.environ.get("LD_LIBRARY_PATH", "")
    return ServerLayout(binary, backend.parent, ":".join(p for p in libs + [existing] if p))


def server_command(layout: ServerLayout, repo: Path, http: int, grpc: int, metrics: int) -> list[str]:
    return [
        str(layout.binary),
        f"--model-repository={repo}",
        f"--backend-directory={layout.backend_dir}",
        f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
        "--strict-readiness=true",
        "--exit-on-error=true",
        "--log-verbose=0",
    ]


def wait_ready(http_port: int, process: subprocess.Popen, timeout_s: float) -> None:
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    deadline = time.monotonic() + timeout_s
    last_note = 0.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() - last_note > 10:
            log("models loading ...")
            last_note = time.monotonic()
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s")


def server_env(layout: ServerLayout) -> dict[str, str]:
    """The environment tritonserver and its stubs need."""
    # The stub's embedded interpreter finds its prefix through the first `python3` on PATH: put the
    # running (venv) interpreter's directory first so the stubs import the venv's packages.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return dict(os.environ, LD_LIBRARY_PATH=layout.ld_library_path, PATH=path)


def prepare(pair_name: str, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Prepare the pair and everything tritonserver needs; returns (command, environment)."""
    pair = pairs.prepare_pair(pair_name)
    repo = repository.render(pair, run_dir / "model_repository")
    layout = triton_layout(run_dir)
    env = server_env(layout)
    ports = (int(os.environ.get("HTTP_PORT", 8000)), int(os.environ.get("GRPC_PORT", 8001)),
             int(os.environ.get("METRICS_PORT", 8002)))
    return server_command(layout, repo, *ports), env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=os.environ.get("PAIR", "default"), choices=sorted(pairs.PAIRS))
    parser.add_argument("--run-dir", default=None, help="where the rendered repository goes (default .cache/run/<pair>)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir or pairs.cache_dir() / "run" / args.pair).resolve()
    command, env = prepare(args.pair, run_dir)
    http_port = int(os.environ.get("HTTP_PORT", 8000))
    log(f"starting tritonserver (pair {args.pair}): {' '.join(command)}")
    process = subprocess.Popen(command, env=env)

    def stop(signum, _frame):
        log(f"signal {signum}: stopping tritonserver")
        if process.poll() is None:
            process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        wait_ready(http_port, process, args.ready_timeout)
        log(f"READY: http://localhost:{http_port} grpc localhost:{os.environ.get('GRPC_PORT', 8001)} "
            f"metrics http://localhost:{os.environ.get('METRICS_PORT', 8002)}/metrics (pair {args.pair})")
    except (RuntimeError, TimeoutError) as exc:
        log(str(exc))
        if process.poll() is None:
            process.terminate()
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        return process.wait()


if __name__ == "__main__":
    sys.exit(main())
