"""A tritonserver started through the launcher as a child process: what benchmarks, load tests and the
integration tests run against. `start` returns once the server is ready (or raises with its log's tail)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.serving.healthcheck import READY_PATH, answers, gateway_url, is_ready
from specdec.serving.metrics_text import scrape, sum_samples
from specdec.serving.launcher import wait_ready


def free_ports(n: int) -> list[int]:
    """n TCP ports free on the loopback interface right now (all bound at once, so distinct)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ServerStartError(RuntimeError):
    pass


def wait_openai(server: "ServerProcess", timeout_s: float) -> None:
    """Until the OpenAI API the launcher started answers its health check (it comes up in a second or two,
    the models far later: this rarely waits)."""
    deadline = time.monotonic() + timeout_s
    while not answers(gateway_url(server.openai_port), 2.0):
        if time.monotonic() > deadline or server.process.poll() is not None:
            raise RuntimeError(f"the OpenAI API does not answer at {gateway_url(server.openai_port)}")
        time.sleep(0.2)


@dataclass
class ServerProcess:
    http_port: int
    grpc_port: int
    metrics_port: int
    health_port: int  # the launcher's readiness endpoint (GET /ready)
    openai_port: int  # the OpenAI API (specdec.gateway) the launcher runs beside the server
    run_dir: Path
    log_path: Path
    process: subprocess.Popen

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://localhost:{self.http_port}"

    @property
    def readiness_url(self) -> str:
        """The launcher's readiness endpoint (the chart's readiness probe)."""
        return f"http://localhost:{self.health_port}{READY_PATH}"

    @property
    def openai_url(self) -> str:
        """The OpenAI API's base URL (what openai.OpenAI(base_url=...) takes)."""
        return f"http://localhost:{self.openai_port}/v1"

    @property
    def metrics_url(self) -> str:
        return f"localhost:{self.metrics_port}"

    def ready(self) -> bool:
        return is_ready(self.http_port)

    def metrics(self) -> str:
        return scrape(self.metrics_url)

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples whose labels include `labels` (0 when there are none)."""
        return sum_samples(self.metrics(), name, **labels)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 90) -> int:
        """SIGTERM the launcher (it stops tritonserver and its stubs); returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # Still draining past the caller's patience: the launcher's second signal stops tritonserver at
        # once and still stops the stubs after it; a killed launcher would leave them orphaned.
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start(run_dir: Path, log_path: Path, launcher_args: list[str], ready_timeout_s: float = 900,
          env: dict[str, str] | None = None) -> ServerProcess:
    """Start `python -m specdec.serving.launcher --run-dir RUN_DIR LAUNCHER_ARGS` on free ports and wait
    until it is ready; its output goes to log_path."""
    http, grpc, metrics, health, openai = free_ports(5)
    env = dict(os.environ if env is None else env, HTTP_PORT=str(http), GRPC_PORT=str(grpc),
               METRICS_PORT=str(metrics), HEALTH_PORT=str(health), OPENAI_PORT=str(openai))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # --run-dir first: launcher_args may end with `-- <tritonserver flags>`.
        process = subprocess.Popen([sys.executable, "-m", "specdec.serving.launcher", "--run-dir", str(run_dir),
                                    *launcher_args], env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(http, grpc, metrics, health, openai, run_dir, log_path, process)
    try:
        wait_ready(http, process, ready_timeout_s, metrics_port=metrics)
        wait_openai(server, 60.0)
    except (RuntimeError, TimeoutError) as exc:
        server.stop(timeout_s=30)
        raise ServerStartError(f"{exc}; launcher log {log_path}:\n{server.log_tail()}") from None
    return server
