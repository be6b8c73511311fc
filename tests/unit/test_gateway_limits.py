"""The open-files limit (gateway/limits.py): the real API process started with a soft limit of 128 raises it
and keeps answering with 200 client connections open (before: every request timed out, and its log filled
with "Too many open files"). And a request body over the API's limit: refused naming it."""

import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdec.gateway.limits import OPEN_FILES, raise_open_files
from specdec.serving import launcher
from specdec.serving.server import free_ports


def soft_open_files(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if "open files" in line)
    return int(line.split()[3])


def test_the_api_raises_a_low_open_files_limit_and_answers_with_many_clients_connected():
    port = free_ports(1)[0]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    process = subprocess.Popen([sys.executable, "-m", "specdec.gateway", "--port", str(port),
                                "--served-model-name", "m", "--grpc-url", "127.0.0.1:1"],
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard)),
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    clients = []
    try:
        deadline = time.monotonic() + 60
        while not launcher.accepts(port, 0.5):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
        assert soft_open_files(process.pid) == want
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
            assert response.status == 200
    finally:
        for client in clients:
            client.close()
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "soft limit raised from 128" in err and "Too many open files" not in err


def test_a_limit_is_never_lowered():
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert raise_open_files(16) == (soft, soft) and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft


def test_a_body_over_the_limit_is_refused_naming_the_limit():
    import asyncio
    import json

    from aiohttp.test_utils import TestClient, TestServer

    from specdec.gateway.app import MAX_BODY_MIB, Gateway

    class Upstream:
        async def close(self):
            pass

    async def main():
        async with TestClient(TestServer(Gateway(Upstream(), ("m",)).app())) as client:
            body = json.dumps({"model": "m", "prompt": "a " * (MAX_BODY_MIB * 1024 * 1024 // 2 + 1), "max_tokens": 1})
            response = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
            return response.status, await response.json()

    status, answer = asyncio.run(main())
    assert status == 413
    assert answer["error"]["message"] == (f"the request body is over the API's limit of {MAX_BODY_MIB} MiB: "
                                          "POST /v1/completions")
