"""Whether the local tritonserver is ready, asked two ways: `python -m specdec.serving.healthcheck` exits 0
when it is (the image's HEALTHCHECK), and the launcher answers GET /ready on HEALTH_PORT (the chart's
readiness probe: an HTTP probe, so the kubelet starts no process in the pod every few seconds).

Ready means /v2/health/ready answers 200 (with --strict-readiness: every model is loaded), the server is
not draining (after SIGTERM the launcher raises a marker and lets the streams in flight finish, and
readiness must drop at once so that new requests go elsewhere), no model is down (the launcher's watchdog
raises a marker naming the models whose stub died until they serve again; watchdog.py), and, where the
launcher runs the OpenAI API (OPENAI_PORT, not 0), its GET /health answers 200 (over TLS where
OPENAI_SSL_CERTFILE says it serves so: gateway/tls.py; at OPENAI_HOST where that names one address). The ports
come from HTTP_PORT (default 8000) and OPENAI_PORT.

The launcher's endpoint also answers GET /live (the chart's liveness probe: 503 once tritonserver stops
answering /v2/health/live or a model has been down for longer than the heal timeout) and GET /metrics
(the watchdog's metrics: restarts and time down per model).
"""

from __future__ import annotations

import http.server
import os
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Callable, Mapping

from specdec.gateway import tls

READY_PATH = "/ready"  # the launcher's readiness endpoint (HEALTH_PORT)
LIVE_PATH = "/live"  # its liveness endpoint
METRICS_PATH = "/metrics"  # the watchdog's metrics
GATEWAY_HEALTH_PATH = "/health"  # the OpenAI API's (specdec.gateway): 200 once it reaches a ready ensemble
WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # every interface


def ready_url(http_port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{http_port}/v2/health/ready"


def live_url(http_port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{http_port}/v2/health/live"


def drain_marker(http_port: int) -> Path:
    """The file whose existence says the server on http_port is draining (written by the launcher)."""
    return Path(tempfile.gettempdir()) / f"specdec-draining-{http_port}"


def down_marker(http_port: int) -> Path:
    """The file naming the models that are down (one "model: reason" line each), while any is."""
    return Path(tempfile.gettempdir()) / f"specdec-down-{http_port}"


def is_ready(http_port: int, timeout_s: float = 4.0, openai_port: int = 0) -> bool:
    """True when the server on http_port reports ready and is not draining, and the OpenAI API on
    openai_port (0: none) answers its health check; any failure to answer is 'not ready'."""
    return not_ready(http_port, timeout_s, openai_port) is None


def answers(url: str, timeout_s: float) -> bool:
    try:
        # Only the OpenAI API answers over TLS (OPENAI_SSL_*: gateway/tls.py), asked as its probe context says.
        context = tls.probe_context(tls.from_env()) if url.startswith("https:") else None
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return response.status == 200
    except OSError:
        return False


def api_host(env: Mapping[str, str] = os.environ) -> str:
    """Where the OpenAI API answers this machine's checks: OPENAI_HOST where it names one address (vLLM's and
    SGLang's --host), else the loopback (it listens on every interface; "localhost" is the loopback too)."""
    host = env.get(tls.HOST_ENV, "")
    if host in WILDCARD_HOSTS or host == "localhost":
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed in a URL


def gateway_url(openai_port: int, host: str | None = None) -> str:
    return f"{tls.from_env().scheme}://{host or api_host()}:{openai_port}{GATEWAY_HEALTH_PATH}"


def not_ready(http_port: int, timeout_s: float = 4.0, openai_port: int = 0) -> str | None:
    """None when the server on http_port (and the OpenAI API on openai_port, unless 0) is ready, else why
    not (one line)."""
    if drain_marker(http_port).exists():
        return f"not ready (draining): {ready_url(http_port)}"
    try:
        down = down_marker(http_port).read_text().strip().replace("\n", "; ")
    except OSError:
        down = ""
    if down:
        return f"not ready: being restored: {down}"
    if not answers(ready_url(http_port), timeout_s):
        return f"not ready: {ready_url(http_port)}"
    if openai_port and not answers(gateway_url(openai_port), timeout_s):
        return f"not ready: the OpenAI API at {gateway_url(openai_port)}"
    return None


def health_port() -> int:
    """The launcher's readiness endpoint's port (HEALTH_PORT, default 8003; 0: no endpoint)."""
    return int(os.environ.get("HEALTH_PORT", 8003))


def openai_port() -> int:
    """The OpenAI API's port (OPENAI_PORT, default 9000, Triton's own OpenAI frontend's; 0: none)."""
    return int(os.environ.get("OPENAI_PORT", 9000))


class ReadinessEndpoint:
    """GET /ready on `port` (all interfaces: the kubelet probes the pod's address): 200 while the server
    on http_port is ready, 503 with the reason otherwise; GET /live (`live_problem`: the watchdog's) and
    GET /metrics (`metrics`); served from a daemon thread of the launcher.
    Raises OSError at construction when the port is taken."""

    def __init__(self, port: int, http_port: int, host: str = "0.0.0.0", openai_port: int = 0,
                 live_problem: Callable[[], str | None] = lambda: None, metrics: Callable[[], str] = lambda: ""):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                # Within the probes' 5 s timeout, with room for the answer.
                if path == READY_PATH:
                    reason = not_ready(http_port, timeout_s=2.0, openai_port=openai_port)
                    self._answer(503 if reason else 200, reason or "ready")
                elif path == LIVE_PATH:
                    problem = live_problem() or (None if answers(live_url(http_port), 2.0) else
                                                 f"not live: {live_url(http_port)}")
                    self._answer(503 if problem else 200, problem or "live")
                elif path == METRICS_PATH:
                    self._answer(200, metrics().rstrip("\n"), "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self._answer(404, f"not found: {self.path} (GET {READY_PATH}, {LIVE_PATH} or {METRICS_PATH})")

            def _answer(self, status: int, text: str, kind: str = "text/plain; charset=utf-8") -> None:
                body = f"{text}\n".encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args):
                pass  # a probe every few seconds would flood the server's log

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="readiness-endpoint")
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> int:
    reason = not_ready(int(os.environ.get("HTTP_PORT", "8000")), openai_port=openai_port())
    if reason:
        print(reason, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
