"""Rollouts and scale-down do not cut streams: SIGTERM to the launcher drops readiness at once, lets the
stream in flight finish, then stops the server cleanly (a server of its own)."""

import subprocess
import sys
import threading
import time

import pytest

from specdec import tensor_names as tn

from .helpers import grpc_stream, start_server, stop_server, stub_processes

pytestmark = pytest.mark.integration


def test_sigterm_during_a_long_stream_lets_it_finish(tmp_path):
    server = start_server(tmp_path)
    result, failure = {}, []

    def stream():
        try:
            result.update(grpc_stream(server.grpc_url, "Once upon a time", max_tokens=200, num_draft_tokens=2,
                                      end_id=0, stream=True, timeout=180))
        except Exception as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    worker = threading.Thread(target=stream)
    worker.start()
    time.sleep(1.5)  # the stream is generating
    assert worker.is_alive()
    try:
        server.process.terminate()  # SIGTERM, as Kubernetes sends it
        time.sleep(0.5)
        assert not server.ready()  # readiness drops at once: new requests go elsewhere
        probe = subprocess.run([sys.executable, "-m", "specdec.serving.healthcheck"], capture_output=True, text=True,
                               env={"HTTP_PORT": str(server.http_port), "PATH": ""})
        assert probe.returncode == 1 and "draining" in probe.stderr
        worker.join(timeout=180)
        code = server.process.wait(timeout=120)  # drained, then stopped by itself
    except BaseException:
        stop_server(server, require_clean_exit=False)
        raise
    assert not failure, failure
    assert result[tn.FINISH_REASON] == tn.FINISH_LENGTH and result[tn.NUM_OUTPUT_TOKENS] == 200
    assert code == 0 and not stub_processes(server.run_dir)
