"""Three launcher options on one real server (tiny pair): `--mps` (a stand-in nvidia-cuda-mps-control, as this
machine has no GPU: the daemon is started before tritonserver with local directories of this launch's own,
every stub is pointed at them, and the daemon is told to quit after the server stopped, its directories
removed), SPECDEC_PROFILE_DIR (each language model's stub profiles its execute calls into a cProfile file
pstats reads) and `--weights-dtype fp8` (both models' linears in FP8; speculation stays exact with respect
to the quantized target)."""

import os
import pstats
from pathlib import Path

import pytest

from client import Client, GenerationParams
from specdec.serving import server as serving_server
from specdec.triton import profiling

from .helpers import READY_TIMEOUT_S, stop_server, stub_processes

pytestmark = pytest.mark.integration


def test_mps_and_profiling_on_a_served_pair(tmp_path, monkeypatch):
    calls = tmp_path / "mps-calls"
    control = tmp_path / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir()
    control.write_text(f"#!/bin/sh\necho \"$* $CUDA_MPS_PIPE_DIRECTORY $(cat)\" >> {calls}\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{control.parent}{os.pathsep}{os.environ['PATH']}")
    profiles = tmp_path / "profiles"
    monkeypatch.setenv(profiling.ENV, str(profiles))  # the launcher's environment reaches every stub
    run_dir = tmp_path / "run"
    server = serving_server.start(run_dir, tmp_path / "server.log", ["--pair", "tiny", "--mps", "--weights-dtype", "fp8"],
                                  ready_timeout_s=READY_TIMEOUT_S)
    try:
        started = calls.read_text().split()
        assert started[0] == "-d" and len(started) == 2  # started, and nothing else yet
        pipe = started[1]  # a directory of this launch's own, local
        assert Path(pipe).is_dir() and Path(pipe).name == "pipe" and Path(pipe).parent.name.startswith("specdec-mps-")
        stubs = stub_processes(server.run_dir)
        assert stubs
        for line in stubs:  # every stub would reach the daemon through its pipe directory
            environ = Path(f"/proc/{line.split()[0]}/environ").read_bytes().split(b"\0")
            assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ, line
        client = Client(server.grpc_url, "grpc")
        alone = client.generate("Hello there", GenerationParams(max_tokens=24, num_draft_tokens=0))
        for _ in range(3):
            # a fixed K: the adaptive rule pauses a draft that does not pay for its measured costs (the tiny pair's)
            result = client.generate("Hello there", GenerationParams(max_tokens=24, num_draft_tokens=3, adaptive_draft=False))
            assert result.num_output_tokens == 24 and result.text == alone.text and result.total_accepted_draft_tokens > 0
    finally:
        stop_server(server)
    assert calls.read_text().split() == ["-d", pipe, pipe, "quit"]  # told to quit once the server was gone
    assert not Path(pipe).parent.exists()  # and its directories removed
    log = server.log_path.read_text(errors="replace")
    assert "CUDA MPS: a daemon of this server's own" in log and "target_model: profiling execute into" in log
    assert log.count("linear layers in FP8") == 2 and "dequantized (not a CUDA device)" in log  # target and draft
    for model, forward in (("target_model", "extend_many"), ("draft_model", "propose_many")):
        files = sorted(profiles.glob(f"{model}-*.prof"))
        assert len(files) == 1, (model, list(profiles.iterdir()))
        functions = {name for (_, _, name) in pstats.Stats(str(files[0])).stats}
        assert {"_execute", "_parse", forward} <= functions, (model, sorted(functions)[:40])
    assert "_execute" in profiling.report(profiles)


def test_mps_without_its_control_binary_stops_the_launcher_with_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not (Path(p) / "nvidia-cuda-mps-control").exists()))
    with pytest.raises(serving_server.ServerStartError, match="nvidia-cuda-mps-control not found on PATH"):
        serving_server.start(tmp_path / "run", tmp_path / "server.log", ["--pair", "tiny", "--mps"],
                             ready_timeout_s=60)
