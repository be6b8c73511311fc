"""`make serve`'s launcher on a server of its own: ready, serving, and SIGTERM stops everything cleanly."""

import re
import subprocess

import pytest

from specdec import tensor_names as tn
from specdec.triton import cancellation, room, slots

from .helpers import GenerationError, grpc_stream, start_server, stop_server, stub_processes

pytestmark = pytest.mark.integration


def test_sigterm_stops_server_and_every_stub_with_exit_code_0(tmp_path):
    server = start_server(tmp_path)
    try:
        # Every Python model instance runs in its own stub: six models once, the orchestrator per instance.
        assert len(stub_processes(server.run_dir)) == 6 + tn.DEFAULT_ORCHESTRATOR_INSTANCES["cpu"]
        log = server.log_path.read_text(errors="replace")
        for model in ("target_model", "draft_model", "draft_model_exact", "draft_model_random"):
            assert f"{model}: warmed up in" in log, model  # before READY: the first requests pay nothing
            assert re.search(rf"{model}: warmed up in [\d.]+ s on cpu, torch threads: [1-9]\d*", log), model
        result = grpc_stream(server.grpc_url, "Hello", max_tokens=8, num_draft_tokens=2, stream=True)
        assert result[tn.NUM_OUTPUT_TOKENS] == 8
        with pytest.raises(GenerationError, match="max_tokens"):
            grpc_stream(server.grpc_url, "Hello", max_tokens=0)
        # The stubs' shared scratch (cancellation flags, live-sequence slots, the KV-room line) is named
        # after tritonserver.
        stub_pid = stub_processes(server.run_dir)[0].split()[0]
        triton_pid = int(subprocess.run(["ps", "-o", "ppid=", "-p", stub_pid], capture_output=True, text=True).stdout)
        scratch = [cancellation.default_directory(triton_pid), room.default_directory(triton_pid),
                   *slots.server_directories(triton_pid)]
        assert len(scratch) == 3 and all(path.is_dir() for path in scratch), scratch
    finally:
        code = stop_server(server)  # asserts: nothing pending, no stub left, exit code 0
    assert code == 0
    assert not any(path.exists() for path in scratch), scratch  # the launcher removed it


def test_the_image_base_is_the_triton_release_the_tests_serve_with(server):
    """The Dockerfile's NGC base image must be the release of the tritonserver every test here runs (the
    one the nvidia-pytriton wheel ships), read from the running server itself."""
    import json
    import urllib.request

    from tests.deploy.test_docker import base_image_release, ngc_release

    with urllib.request.urlopen(f"{server.http_url}/v2", timeout=10) as response:
        version = json.loads(response.read())["version"]
    assert ngc_release(version) == base_image_release(), version


def test_the_stubs_run_with_the_launchers_openmp_spin_limit(server):
    """Every model's stub inherits GOMP_SPINCOUNT: with libgomp's default an idle model's workers keep a
    core busy for milliseconds after each forward, through the next model's (README, "Where a served round goes")."""
    import os

    from specdec.serving.launcher import STUB_ENV_DEFAULTS

    expected = os.environ.get("GOMP_SPINCOUNT", STUB_ENV_DEFAULTS["GOMP_SPINCOUNT"])
    stubs = stub_processes(server.run_dir)
    assert stubs
    for line in stubs:
        pid = line.split()[0]
        with open(f"/proc/{pid}/environ", "rb") as env:
            variables = dict(item.split(b"=", 1) for item in env.read().split(b"\0") if b"=" in item)
        assert variables.get(b"GOMP_SPINCOUNT") == expected.encode(), line
