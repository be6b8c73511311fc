"""When the launcher counts tritonserver as crashed (serving/server_process.py), and what it does then.

A real server's crash that exits is tested in test_self_healing.py (SIGABRT to tritonserver). A crash
whose exit hangs (Triton's fatal-signal handler calls exit(), which can deadlock: seen once in CI) cannot
be produced on demand with the real server, so the launcher's whole loop is run here with a stand-in
binary given as --triton-root: it answers the readiness and metrics endpoints, writes Triton's line for a
fatal signal, and hangs on, still answering."""

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


from specdec.serving import launcher
from specdec.serving.server import free_ports
from specdec.serving.server_process import ServerProcess, die_with_launcher, exit_timeout
from tests.http_get import get
from tests.polling import wait_for


def run(script: str, grace_s: float = 0.3) -> tuple[ServerProcess, io.BytesIO]:
    out = io.BytesIO()
    return ServerProcess([sys.executable, "-c", textwrap.dedent(script)], dict(os.environ), out=out,
                         grace_s=grace_s), out


def until(condition, timeout_s: float = 10.0):
    return wait_for(condition, timeout_s, "the condition", every_s=0.05)


def test_a_fatal_signal_line_counts_as_a_crash_once_the_grace_has_passed():
    server, out = run("""
        import sys, time
        print("I1201 some log line", flush=True)
        print("Signal (6) received.", file=sys.stderr, flush=True)
        time.sleep(60)
    """, grace_s=0.5)
    try:
        until(lambda: server.fatal is not None)
        assert server.crash() is None  # Triton's own exit may still come
        reason = until(server.crash)
        assert reason == "reported SIGABRT and has not exited 0.5 s later"
        assert b"I1201 some log line\nSignal (6) received.\n" == out.getvalue()  # copied through, in order
    finally:
        server.process.kill()
        server.process.wait()


def test_a_graceful_stops_signal_line_is_no_crash():
    server, _ = run("""
        import time
        print("Signal (15) received.", flush=True)
        time.sleep(60)
    """, grace_s=0.1)
    try:
        time.sleep(0.8)
        assert server.fatal is None and server.crash() is None
    finally:
        server.process.kill()
        server.process.wait()


def test_an_exit_is_a_crash_naming_the_signal_or_code():
    aborted, _ = run("import os; os.abort()")
    until(lambda: aborted.process.poll() is not None)
    assert aborted.crash() == "exited with code -6 (SIGABRT)"
    failed, _ = run("raise SystemExit(3)")
    until(lambda: failed.process.poll() is not None)
    assert failed.crash() == "exited with code 3"


def test_a_start_counts_as_stalled_once_its_models_loaded_that_long_ago():
    server, _ = run("""
        import time
        print("| Backend | Path | Config |", flush=True)
        time.sleep(1)
        print("| Model                | Version | Status |", flush=True)
        time.sleep(60)
    """)
    server.stall_s = 0.5
    try:
        until(lambda: b"Backend" in server.out.getvalue())
        assert server.stalled() is None  # still loading: a slow load is --ready-timeout's business
        until(lambda: server.loaded_at is not None)
        assert server.stalled() is None
        assert until(server.stalled) == "loaded its models and has not opened its endpoints 0.5 s later"
    finally:
        server.process.kill()
        server.process.wait()


IGNORES_SIGTERM = """
    import signal, sys, time
    def stopping(*_):  # Triton's stop: models unload, then (with {unloaded}) its last line before the endpoints
        if {unloaded}:
            print('I1205 server.cc:345] "Timeout 27: Found {live} live models and 0 in-flight non-inference '
                  'requests"', flush=True)
        {then}
    signal.signal(signal.SIGTERM, stopping)
    print("serving", flush=True)
    while True:
        time.sleep(1)
"""


def stopping(unloaded: bool, then: str, *args: str, live: int = 0, stranded: int = 0
             ) -> tuple[ServerProcess, list[str]]:
    """A stand-in asked to stop (SIGTERM) once it serves; `then`: what its handler does after the unloading
    (which leaves `live` models); `stranded`: the models the launcher told it cannot unload."""
    script = textwrap.dedent(IGNORES_SIGTERM.format(unloaded=unloaded, then=then, live=live))
    server = ServerProcess([sys.executable, "-c", script, *args], dict(os.environ), out=io.BytesIO())
    server.stranded_models = stranded
    until(lambda: b"serving" in server.out.getvalue())
    server.process.terminate()
    return server, []


def test_a_stop_held_after_every_model_unloaded_is_killed_and_counts_as_a_clean_stop():
    """Triton 2.51 with an open gRPC stream: its models unload, its endpoint's stop waits for ever."""
    server, logged = stopping(True, "pass")
    started = time.monotonic()
    assert server.stopped(logged.append, grace_s=0.5) == 0
    assert 0.5 <= time.monotonic() - started < 5 and server.process.poll() == -signal.SIGKILL
    assert logged == ["tritonserver unloaded its models and did not exit 0.5 s later (an open gRPC stream holds "
                      "its endpoint): killed"]


def test_a_stop_left_with_only_the_models_of_stubs_that_died_serving_is_killed_at_once():
    """Triton 24.10 never unloads a model version whose stub died with requests in flight: once only those are
    live, nothing else happens until its exit timeout. Told of them, the stop ends there (a clean stop); not
    told (or with more live than those), it waits the exit timeout out."""
    server, logged = stopping(True, "pass", "--exit-timeout-secs=20", live=2, stranded=2)
    started = time.monotonic()
    assert server.stopped(logged.append, grace_s=5) == 0
    assert time.monotonic() - started < 3 and server.process.poll() == -signal.SIGKILL
    assert logged == ["tritonserver unloaded every model but the 2 held by stubs that died serving requests "
                      "(Triton never releases those): killed"]
    server, logged = stopping(True, "pass", "--exit-timeout-secs=1", live=2, stranded=1)
    assert server.stopped(logged.append, grace_s=0.5) == -signal.SIGKILL
    assert logged == ["tritonserver did not stop within its exit timeout and 0.5 s: killed"]


def test_a_stop_that_ends_by_itself_keeps_its_code_and_one_that_never_unloads_ends_at_its_exit_timeout():
    server, logged = stopping(True, "sys.exit(3)")
    assert server.stopped(logged.append, grace_s=5) == 3 and not logged
    server, logged = stopping(False, "pass", "--exit-timeout-secs=1")
    assert server.exit_timeout_s == 1
    started = time.monotonic()
    assert server.stopped(logged.append, grace_s=0.5) == -signal.SIGKILL
    assert 1.5 <= time.monotonic() - started < 6
    assert logged == ["tritonserver did not stop within its exit timeout and 0.5 s: killed"]
    assert [exit_timeout(["tritonserver", *args]) for args in (
        [], ["--exit-timeout-secs", "7"], ["--exit-timeout-secs=2.5"], ["--exit-timeout-secs=x"])] == [30, 7, 2.5, 30]


def test_without_an_nvidia_device_the_server_gets_no_gpu_metrics(tmp_path):
    layout = launcher.ServerLayout(Path("tritonserver"), Path("backends"), "")
    assert not launcher.nvidia_device(tmp_path)
    (tmp_path / "nvidiactl").touch()
    assert launcher.nvidia_device(tmp_path)
    command = launcher.server_command(layout, Path("repo"), 1, 2, 3, ["--allow-gpu-metrics=true"])
    assert ("--allow-gpu-metrics=false" in command) == (not launcher.nvidia_device())
    assert command[-1] == "--allow-gpu-metrics=true"  # the operator's flags come last, and win


STAND_IN = """\
#!{python}
# Stands in for tritonserver: answers readiness and metrics. Its first start, by BEHAVIOUR: "abort" reports
# SIGABRT once ready and hangs on; "stall" prints its table of models and never opens its endpoints.
import http.server, os, sys, threading, time
from pathlib import Path
BEHAVIOUR = "{behaviour}"
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
starts = Path(__file__).with_name("starts")
n = int(starts.read_text()) + 1 if starts.exists() else 1
starts.write_text(str(n))
Path(__file__).with_name(f"pid{{n}}").write_text(str(os.getpid()))
print("| Model                | Version | Status |", flush=True)
while n == 1 and BEHAVIOUR == "stall":
    time.sleep(1)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *_):
        pass

for port in (args["http-port"], args["metrics-port"]):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print(f"stand-in start {{n}} serving", flush=True)
if n == 1 and BEHAVIOUR == "abort":
    time.sleep(1.5)
    print("Signal (6) received.", file=sys.stderr, flush=True)
while True:
    time.sleep(1)
"""


@contextlib.contextmanager
def launched(tmp_path: Path, behaviour: str, *args: str):
    """The launcher over the stand-in server (`behaviour`), with its output in tmp_path/launcher.log;
    yields the stand-in's directory, the log and the launcher's health port; stops it with SIGTERM and
    checks that no stand-in outlives it."""
    root = tmp_path / "triton"
    (root / "bin").mkdir(parents=True, exist_ok=True)  # a second launch over the same directory: another start
    binary = root / "bin" / "tritonserver"
    binary.write_text(STAND_IN.format(python=sys.executable, behaviour=behaviour))
    binary.chmod(0o755)
    (repo := tmp_path / "repo").mkdir(exist_ok=True)
    http, grpc, metrics, health = free_ports(4)
    env = {**os.environ, "HTTP_PORT": str(http), "GRPC_PORT": str(grpc), "METRICS_PORT": str(metrics),
           "HEALTH_PORT": str(health), "OPENAI_PORT": "0"}
    log = tmp_path / "launcher.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "specdec.serving.launcher", "--model-repository", str(repo),
                                    "--run-dir", str(tmp_path / "run"), "--triton-root", str(root), *args],
                                   env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield root / "bin", log, health
    finally:
        process.send_signal(signal.SIGTERM)  # nothing where a test killed it
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert all(gone(pid) for pid in (root / "bin").glob("pid*")), "a stand-in server outlived the launcher"


def gone(pid_file: Path) -> bool:
    """Exited (a zombie counts: an orphan's reaper here may never reap it)."""
    pid = int(pid_file.read_text())
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def test_the_launcher_restarts_a_server_that_reported_a_fatal_signal_and_hangs(tmp_path):
    with launched(tmp_path, "abort") as (stand_in, log, health):
        metrics_url = f"http://127.0.0.1:{health}/metrics"
        until(lambda: "specdec_server_crashes_total 1" in get(metrics_url)[1], 30)
        until(lambda: (stand_in / "pid2").exists(), 10)
        until(lambda: "specdec_server_restarts_total 1" in get(metrics_url)[1], 20)
        assert get(f"http://127.0.0.1:{health}/ready")[0] == 200
        assert get(f"http://127.0.0.1:{health}/live")[0] == 200
        assert gone(stand_in / "pid1")
        output = log.read_text()
        assert "stand-in start 1" in output and "Signal (6) received." in output  # its output passed through
        assert "tritonserver reported SIGABRT and has not exited 5 s later; restarting it" in output, output
        assert "watchdog: tritonserver restarted and ready (server restart 1)" in output


def test_the_launcher_starts_again_a_server_whose_start_stalled(tmp_path):
    with launched(tmp_path, "stall", "--stall-timeout", "1") as (stand_in, log, health):
        until(lambda: "READY" in log.read_text(), 30)
        assert get(f"http://127.0.0.1:{health}/ready")[0] == 200
        output = log.read_text()
        assert ("tritonserver loaded its models and has not opened its endpoints 1 s later; starting it again "
                "(start 2 of at most 3)") in output, output
        assert "stand-in start 2 serving" in output
        assert (stand_in / "starts").read_text() == "2"
        assert gone(stand_in / "pid1")


def test_a_launcher_killed_outright_takes_its_server_with_it_and_the_next_removes_its_scratch(tmp_path):
    """SIGKILL (or the OOM killer) gives the launcher no chance to stop anything: the kernel sends its server
    SIGTERM (`die_with_launcher`), which would otherwise hold the ports the next start needs; the scratch
    directories its stubs shared stay, and the next launcher of the run directory removes them."""
    from specdec.triton.admission import kv_room

    with launched(tmp_path, "serve") as (stand_in, log, health):
        until(lambda: "READY" in log.read_text(), 30)
        server = int((stand_in / "pid1").read_text())
        os.kill(int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
        try:
            until(lambda: gone(stand_in / "pid1"), 10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)
    assert (tmp_path / "run" / launcher.SERVER_PID_FILE).read_text() == f"{server}\n"
    left = kv_room.default_directory(server)  # as its stubs would have left it
    left.mkdir()
    (left / "ticket").touch()
    try:
        with launched(tmp_path, "serve") as (stand_in, log, health):
            until(lambda: "READY" in log.read_text(), 30)
            assert not left.exists()
            assert "removed 1 scratch directories of this run directory's last server" in log.read_text()
    finally:
        shutil.rmtree(left, ignore_errors=True)


def test_a_child_whose_launcher_died_before_it_was_bound_stops_itself(monkeypatch):
    """The kernel sends nothing for a parent that died before the prctl: the child checks and stops."""
    monkeypatch.setattr(os, "getpid", lambda: 1)  # the parent the child expects: not the one it has
    bind = die_with_launcher()
    monkeypatch.undo()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=bind)
    assert child.wait(10) == -signal.SIGTERM
    bound = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=die_with_launcher())
    assert bound.wait(10) == 0
