"""Rollouts and scale-down do not cut streams: SIGTERM to the launcher drops readiness at once, lets the
stream in flight finish, then stops the server cleanly (a server of its own)."""

import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from client import Client, GenerationParams

from .helpers import start_server, stop_server, stub_processes

pytestmark = pytest.mark.integration

TOKENS = 300


def _readiness(server) -> tuple[int, str]:
    """What the launcher's readiness endpoint answers."""
    try:
        with urllib.request.urlopen(server.readiness_url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_sigterm_during_a_long_stream_lets_it_finish(tmp_path):
    server = start_server(tmp_path)
    results, failures = [], []
    first_text = threading.Event()

    def stream():
        try:
            params = GenerationParams(max_tokens=TOKENS, num_draft_tokens=2, ignore_eos=True)
            results.append(Client(server.grpc_url, timeout_s=300).generate(
                "Once upon a time", params, stream=True, on_text=lambda _delta: first_text.set()))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        first_text.set()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert _readiness(server) == (200, "ready\n")  # the chart's readiness probe
        assert first_text.wait(timeout=120)
        assert worker.is_alive(), (failures, results)  # still generating: 300 tokens take seconds
        server.process.terminate()  # SIGTERM, as Kubernetes sends it
        deadline = time.monotonic() + 5
        while server.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.ready()  # readiness drops at once: new requests go elsewhere
        probe = subprocess.run([sys.executable, "-m", "specdec.serving.healthcheck"], capture_output=True, text=True,
                               env={"HTTP_PORT": str(server.http_port), "PATH": ""})
        assert probe.returncode == 1 and "draining" in probe.stderr
        status, text = _readiness(server)
        assert status == 503 and "draining" in text
        worker.join(timeout=240)
        code = server.process.wait(timeout=120)  # drained, then stopped by itself
    except BaseException:
        stop_server(server, require_clean_exit=False)
        raise
    assert not failures, failures
    (result,) = results
    assert result.finish_reason == "length" and result.num_output_tokens == TOKENS
    assert code == 0 and not stub_processes(server.run_dir)
