"""The launcher's wait for a server: HTTP readiness alone is not enough, the metrics endpoint must listen
too (Triton opens it some tens of milliseconds after HTTP, and the first scrape of a test or of the
drain would be refused)."""

import http.server
import socket
import threading

import pytest

from specdec.serving import launcher
from specdec.serving.server import free_ports


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *_args):
        pass


class _Running:
    """Stands in for the tritonserver process: still running."""

    def poll(self):
        return None


@pytest.fixture
def ready_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_ready_waits_for_the_metrics_endpoint(ready_http):
    (metrics_port,) = free_ports(1)
    with pytest.raises(TimeoutError):
        launcher.wait_ready(ready_http, _Running(), timeout_s=1.2, metrics_port=metrics_port)
    launcher.wait_ready(ready_http, _Running(), timeout_s=1.2)  # without a metrics port: HTTP suffices
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", metrics_port))
        listener.listen()
        launcher.wait_ready(ready_http, _Running(), timeout_s=5, metrics_port=metrics_port)
