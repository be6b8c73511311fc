"""The launcher's watchdog (serving/watchdog.py) against stand-ins for /proc, the clock and Triton's model
repository API: a dead or stopped stub marks its model down (readiness names it), the model is reloaded in
place or the server restart is asked for, a model that keeps dying backs off instead of spinning, and
liveness fails only past the heal timeout. The real thing, with SIGKILLed stubs: test_self_healing.py."""

import http.server
import tempfile
import threading

import pytest

from tests.http_get import get as _get
from specdec.serving import healthcheck, watchdog
from specdec.serving.watchdog import Stub, Watchdog

SERVER = 4242
PORT = 18765


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Stubs:
    """The server's stub processes, edited by the test."""

    def __init__(self):
        self.running = {"target_model_0_0": Stub(11, "target_model", "target_model_0_0", "S", "shm-a"),
                        "draft_model_0_0": Stub(12, "draft_model", "draft_model_0_0", "S", "shm-b"),
                        "speculative_decoding_0_0": Stub(13, "speculative_decoding", "speculative_decoding_0_0", "S"),
                        "speculative_decoding_0_1": Stub(14, "speculative_decoding", "speculative_decoding_0_1", "S")}
        self.models = {name: stub.model for name, stub in self.running.items()}
        self.next_pid = 100

    server = SERVER  # the pid of the server whose stubs these are

    def __call__(self, server_pid: int) -> list[Stub]:
        assert server_pid == self.server
        return list(self.running.values())

    def kill(self, instance: str) -> None:
        del self.running[instance]

    def restart(self, model: str) -> None:
        """What a reload does: new stubs (new pids) for the model's instances."""
        for name, owner in self.models.items():
            if owner == model:
                self.next_pid += 1
                self.running[name] = Stub(self.next_pid, model, name, "S", f"shm-{self.next_pid}")


class Control:
    def __init__(self, stubs: Stubs, fail: int = 0):
        self.stubs, self.fail, self.reloads = stubs, fail, []

    def decoupled(self, model: str) -> bool:
        return model == "speculative_decoding"

    def instances(self) -> dict[str, set[str]]:
        """What the server's configs say its Python models run (whether their stubs still do or not)."""
        found: dict[str, set[str]] = {}
        for instance, model in self.stubs.models.items():
            found.setdefault(model, set()).add(instance)
        return found

    def reload(self, model: str, incarnation: int) -> None:
        self.reloads.append((model, incarnation))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("HTTP 400 load failed")
        self.stubs.restart(model)


@pytest.fixture(autouse=True)
def own_tempdir(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the down marker goes there


def make(control_fail: int = 0, heal_timeout_s: float = 300.0, no_control: bool = False):
    stubs, clock, killed = Stubs(), Clock(), []
    control = Control(stubs, control_fail)
    dog = Watchdog(PORT, None if no_control else control, heal_timeout_s=heal_timeout_s, log=lambda _: None,
                   stubs=stubs, clock=clock, kill=killed.append)
    dog.arm(SERVER)
    return dog, stubs, clock, control, killed


def test_a_dead_stub_marks_its_model_down_and_is_reloaded_in_place():
    dog, stubs, clock, control, _ = make()
    dog.tick()
    assert control.reloads == [] and healthcheck.not_ready(PORT, 0.2) != "" and not dog.down_now()
    stubs.kill("target_model_0_0")
    stubs.running["target_model_0_0"] = Stub(11, "target_model", "target_model_0_0", "Z")  # a zombie is dead
    clock.now += 0.5
    dog.tick()  # noticed and healed in the same look (the first attempt waits for nothing)
    assert control.reloads == [("target_model", 1)]
    assert not dog.down_now() and not healthcheck.down_marker(PORT).exists()
    text = dog.metrics_text()
    assert 'specdec_model_restarts_total{model="target_model"} 1' in text
    assert 'specdec_model_up{model="target_model"} 1' in text
    assert 'specdec_model_restarts_total{model="draft_model"} 0' in text
    assert "shm-a" in dog.regions and any(r.startswith("shm-1") for r in dog.regions)


@pytest.mark.parametrize("control", [True, False])
def test_a_stub_dead_before_the_watchdog_armed_is_healed(control):
    """The instances to watch come from the server's configs: a stub that died between readiness and the
    first look is missed by a list of the running ones (without model control that is all there is)."""
    stubs, clock = Stubs(), Clock()
    reloads = Control(stubs)
    dog = Watchdog(PORT, reloads if control else None, log=lambda _: None, stubs=stubs, clock=clock,
                   kill=lambda pid: None)
    stubs.kill("draft_model_0_0")
    stubs.kill("speculative_decoding_0_1")
    dog.arm(SERVER)
    dog.tick()
    if control:
        assert reloads.reloads == [("draft_model", 1)]  # reloaded in place
        assert dog.restart_wanted.is_set()  # the orchestrator's missing instance: the server restarts
    else:
        assert "draft_model" not in dog.models and not dog.restart_wanted.is_set()


def test_readiness_names_a_model_while_it_is_down():
    dog, stubs, clock, control, _ = make(control_fail=1)
    stubs.kill("draft_model_0_0")
    dog.tick()  # the reload fails: down until the next attempt
    assert dog.down_now() == {"draft_model": "its stub draft_model_0_0 died"}
    reason = healthcheck.not_ready(PORT, 0.2)
    assert "draft_model: its stub draft_model_0_0 died" in reason
    assert 'specdec_model_up{model="draft_model"} 0' in dog.metrics_text()
    clock.now += 1.0
    dog.tick()
    assert len(control.reloads) == 2 and not dog.down_now() and not healthcheck.down_marker(PORT).exists()
    assert 'specdec_model_down_seconds_total{model="draft_model"} 1.000' in dog.metrics_text()


def test_an_old_stub_exiting_beside_its_successor_is_not_a_death():
    dog, stubs, clock, control, _ = make()
    running = stubs.running
    stubs.running = {"old": Stub(9, "target_model", "target_model_0_0", "Z"), **running}  # listed first...
    dog.tick()
    stubs.running = {**running, "old": Stub(9, "target_model", "target_model_0_0", "Z")}  # ... or last
    dog.tick()
    assert not dog.down_now() and control.reloads == []


def test_a_model_that_keeps_dying_backs_off_instead_of_spinning():
    dog, stubs, clock, control, _ = make()
    times = []
    for _ in range(600):  # a minute of looks every 0.1 s; the stub dies again at once after every reload
        if "target_model_0_0" in stubs.running:
            stubs.kill("target_model_0_0")
        before = len(control.reloads)
        dog.tick()
        if len(control.reloads) > before:
            times.append(round(clock.now - 1000.0, 1))
        clock.now += 0.1
    gaps = [round(b - a, 1) for a, b in zip(times, times[1:])]
    # Doubling from 1 s (up to 60 s), counted from the look that found it dead again.
    assert len(gaps) == 5 and all(2 ** i <= gap <= 2 ** i + 0.25 for i, gap in enumerate(gaps)), times


def test_a_model_that_stayed_up_is_healed_at_once_again():
    dog, stubs, clock, control, _ = make()
    stubs.kill("target_model_0_0")
    dog.tick()
    clock.now += watchdog.STABLE_S + 1
    stubs.kill("target_model_0_0")
    dog.tick()
    assert len(control.reloads) == 2  # no backoff: it had stayed up


def test_a_decoupled_model_or_no_model_control_asks_for_a_server_restart():
    dog, stubs, clock, control, _ = make()
    stubs.kill("speculative_decoding_0_1")
    dog.tick()
    assert dog.restart_wanted.is_set() and control.reloads == []
    assert dog.dead_instances() == {"speculative_decoding_0_0", "speculative_decoding_0_1"}
    dog.tick()  # nothing more while the launcher restarts it
    stubs.restart("speculative_decoding")
    stubs.running["speculative_decoding_0_1"] = Stub(300, "speculative_decoding", "speculative_decoding_0_1", "S")
    dog.arm(SERVER)  # the launcher, once the (here: same) server is ready again
    assert not dog.restart_wanted.is_set() and not dog.down_now()

    dog, stubs, clock, control, _ = make(no_control=True)
    stubs.kill("draft_model_0_0")
    dog.tick()
    assert dog.restart_wanted.is_set()


def test_a_stub_stopped_past_its_grace_is_killed_and_reloaded():
    dog, stubs, clock, control, killed = make()
    stubs.running["draft_model_0_0"] = Stub(12, "draft_model", "draft_model_0_0", "T")
    dog.tick()
    clock.now += watchdog.STOPPED_GRACE_S - 1
    dog.tick()
    assert not dog.down_now() and control.reloads == []  # a short pause (a debugger) is not a failure
    clock.now += 1.5
    dog.tick()
    assert killed == [12] and control.reloads == [("draft_model", 1)]


def test_liveness_fails_only_past_the_heal_timeout():
    dog, stubs, clock, control, _ = make(control_fail=100, heal_timeout_s=30)
    stubs.kill("target_model_0_0")
    for _ in range(25):
        dog.tick()
        clock.now += 1.0
    assert dog.live_problem() is None
    clock.now += 6
    problem = dog.live_problem()
    assert "target_model has been down for 31 s" in problem


def test_a_crashed_server_is_named_backs_off_when_it_keeps_crashing_and_fails_liveness_past_the_timeout():
    dog, stubs, clock, control, _ = make(heal_timeout_s=120.0)
    waits = []
    for _ in range(3):  # each restart comes up and crashes again at once
        waits.append(dog.server_down("exited with code -6 (SIGABRT)"))
        assert dog.restart_wanted.is_set()  # the looks pause: the dead server's stubs are gone, no model died
        assert "tritonserver: exited with code -6 (SIGABRT)" in healthcheck.not_ready(PORT, 0.2)
        stubs.kill("target_model_0_0")
        dog.tick()
        assert control.reloads == [] and set(dog.down_now()) == {"tritonserver"}
        clock.now += 10.0
        stubs.restart("target_model")
        stubs.server += 1
        dog.arm(stubs.server)  # the new server is ready
        assert not dog.down_now() and not dog.restart_wanted.is_set() and not healthcheck.down_marker(PORT).exists()
    assert waits == [0.0, 1.0, 2.0]
    clock.now += 61.0  # up for longer than STABLE_S: the next crash restarts at once again
    assert dog.server_down("reported SIGSEGV and has not exited 5 s later") == 0.0
    assert dog.live_problem() is None
    clock.now += 121.0  # the restarted server never came up
    assert "tritonserver has been down for 121 s" in dog.live_problem()
    text = dog.metrics_text()
    assert "specdec_server_crashes_total 4" in text and "specdec_server_restarts_total 3" in text


def test_a_model_left_calls_unanswered_has_its_stubs_killed_then_is_healed():
    """The orchestrator counts calls a model did not answer within model_call_timeout_s (a hung stub whose
    process runs); a growing count gets the model's stubs killed, and their death heals it as usual."""
    counts, reads = {"target_model": 0.0}, []

    def stalls():
        reads.append(clock.now)
        if counts is None:
            raise OSError("the metrics do not answer")
        return dict(counts)

    stubs, clock, killed = Stubs(), Clock(), []
    control = Control(stubs)
    dog = Watchdog(PORT, control, log=lambda _: None, stubs=stubs, clock=clock, kill=killed.append, stalls=stalls)
    dog.arm(SERVER)
    dog.tick()
    counts["target_model"] = 1.0
    clock.now += 1.0
    dog.tick()  # read at most every STALL_LOOK_S
    assert killed == [] and len(reads) == 1
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()
    assert killed == [11] and len(reads) == 2  # target_model's stub
    stubs.kill("target_model_0_0")
    clock.now += 1.0
    dog.tick()
    assert control.reloads == [("target_model", 1)] and not dog.down_now()
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()  # the same count: nothing more
    assert killed == [11]
    counts = None
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()  # unreadable: nothing happens
    counts = {"target_model": 1.0, "draft_model": 2.0}
    stubs.server += 1
    dog.arm(stubs.server)  # a new server counts from 0 ...
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()  # ... so these are new
    assert sorted(killed) == [11, 12, stubs.running["target_model_0_0"].pid]


def test_an_orchestrator_whose_loop_stops_turning_while_generating_is_killed_for_a_server_restart():
    """Each orchestrator instance counts its event loop's turns; one that generates and has not counted for
    hang_timeout_s is hung: its stub is killed (a dead decoupled stub: the server is restarted). An idle
    instance's still count is no hang, nor is a count that moves; unreadable metrics change nothing."""
    readings = {"speculative_decoding_0_0": (10.0, 2.0), "speculative_decoding_0_1": (7.0, 0.0)}

    def heartbeats():
        if readings is None:
            raise OSError("the metrics do not answer")
        return dict(readings)

    stubs, clock, killed, lines = Stubs(), Clock(), [], []
    dog = Watchdog(PORT, Control(stubs), log=lines.append, stubs=stubs, clock=clock, kill=killed.append,
                   heartbeats=heartbeats, hang_timeout_s=20.0)
    dog.arm(SERVER)

    def look(seconds: float) -> None:
        clock.now += seconds
        dog.tick()

    look(0.0)
    for _ in range(3):  # _0_0 turns, _0_1 idle: nothing, however long
        readings["speculative_decoding_0_0"] = (readings["speculative_decoding_0_0"][0] + 5.0, 2.0)
        look(watchdog.STALL_LOOK_S * 4)
    assert killed == []
    readings = None
    look(watchdog.STALL_LOOK_S * 8)  # unreadable for 40 s: nothing
    readings = {"speculative_decoding_0_0": (25.0, 2.0), "speculative_decoding_0_1": (7.0, 0.0)}
    look(watchdog.STALL_LOOK_S)  # _0_0's count has not moved since it was last read (40 s ago): hung
    assert killed == [13] and "speculative_decoding_0_0's event loop has not turned for 45 s with 2 request(s)" \
        in lines[-1], lines
    assert "specdec_orchestrator_hangs_total 1" in dog.metrics_text()
    stubs.kill("speculative_decoding_0_0")
    look(1.0)
    assert dog.restart_wanted.is_set()  # healed as any dead orchestrator
    stubs.server += 1
    stubs.restart("speculative_decoding")  # the new server's stubs: pids 101, 102
    dog.arm(stubs.server)  # its instances count from 0, and their clocks start again
    readings = {"speculative_decoding_0_0": (3.0, 1.0), "speculative_decoding_0_1": (3.0, 1.0)}
    look(watchdog.STALL_LOOK_S)  # first read
    look(watchdog.STALL_LOOK_S * 3)  # still for 15 s < 20 s
    assert killed == [13]
    look(watchdog.STALL_LOOK_S)  # 20 s: both
    assert killed == [13, 101, 102]
    off = Watchdog(PORT, Control(stubs), log=lambda _: None, stubs=stubs, clock=clock, kill=killed.append,
                   heartbeats=heartbeats, hang_timeout_s=0.0)
    off.arm(stubs.server)
    before = list(killed)
    for _ in range(10):
        clock.now += watchdog.STALL_LOOK_S * 4
        off.tick()
    assert killed == before  # hang_timeout_s 0: never


def test_stubs_are_read_from_proc(tmp_path):
    def process(pid: int, ppid: int, state: str, args: list[str]):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (weird ) name) {state} {ppid} 1 2 3\n")
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")

    stub = "/x/backends/python/triton_python_backend_stub"
    process(20, SERVER, "S", [stub, "/repo/target_model/1/model.py", "shm-t", "1", "1", str(SERVER), "/x", "336",
                              "target_model_0_0", "DEFAULT"])
    process(21, SERVER, "Z", [stub, "/repo/draft_model/1/model.py", "shm-d", "1", "1", str(SERVER), "/x", "336",
                              "draft_model_0_0", "DEFAULT"])
    process(22, 999, "S", [stub, "/other/target_model/1/model.py", "s", "1", "1", "999", "/x", "336", "t_0_0", "D"])
    process(23, SERVER, "S", ["/usr/bin/python3", "-c", "pass"])
    (tmp_path / "self").mkdir()
    found = sorted(watchdog.stubs_of(SERVER, tmp_path), key=lambda s: s.pid)
    assert found == [Stub(20, "target_model", "target_model_0_0", "S", "shm-t"),
                     Stub(21, "draft_model", "draft_model_0_0", "Z", "shm-d")]


def test_the_server_arguments_give_the_control_mode_and_the_repository_key():
    args = ["--model-control-mode=explicit", "--load-model=*",
            "--http-restricted-api=model-repository,shared-memory:admin-key=s3cr=t", "--log-verbose=0"]
    assert watchdog.control_mode(args) == "explicit"
    assert watchdog.control_mode(["--log-verbose=0"]) == "none"
    assert watchdog.restricted_header(args) == ("admin-key", "s3cr=t")
    assert watchdog.restricted_header(["--http-restricted-api=health:k=v"]) is None


class _Triton(http.server.BaseHTTPRequestHandler):
    live = True

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        ok = self.path == "/v2/health/ready" or (self.path == "/v2/health/live" and _Triton.live)
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *_args):
        pass


def test_the_launchers_endpoint_answers_ready_live_and_metrics():
    triton = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Triton)
    threading.Thread(target=triton.serve_forever, daemon=True).start()
    http_port = triton.server_address[1]
    dog = Watchdog(http_port, None, heal_timeout_s=10, log=lambda _: None, stubs=Stubs(), clock=Clock())
    dog.arm(SERVER)
    endpoint = healthcheck.ReadinessEndpoint(0, http_port, host="127.0.0.1", live_problem=dog.live_problem,
                                             metrics=dog.metrics_text)
    url = f"http://127.0.0.1:{endpoint.port}"
    try:
        assert _get(url + "/ready") == (200, "ready\n") and _get(url + "/live") == (200, "live\n")
        status, text = _get(url + "/metrics")
        assert status == 200 and 'specdec_model_up{model="target_model"} 1' in text
        dog.stubs.kill("draft_model_0_0")
        dog.tick()
        status, text = _get(url + "/ready")
        assert status == 503 and "draft_model" in text
        assert _get(url + "/live")[0] == 200  # within the heal timeout
        dog.clock.now += 11
        status, text = _get(url + "/live")
        assert status == 503 and "draft_model has been down" in text
        _Triton.live = False
        dog.clock.now -= 11
        status, text = _get(url + "/live")
        assert status == 503 and "/v2/health/live" in text
    finally:
        _Triton.live = True
        endpoint.close()
        dog.close()
        triton.shutdown()
        triton.server_close()


def text_model_watchdog(hang_timeout_s: float = 30):
    """A watchdog whose server runs preprocessing too, with the stamps and queues the test edits."""
    stubs, clock, killed, lines = Stubs(), Clock(), [], []
    stubs.running["preprocessing_0_0"] = Stub(21, "preprocessing", "preprocessing_0_0", "S")
    stubs.models["preprocessing_0_0"] = "preprocessing"
    wall, stamps, queues = [5000.0], {"preprocessing_0_0": (0.0, 21)}, {}
    control = Control(stubs)
    dog = Watchdog(PORT, control, log=lines.append, stubs=stubs, clock=clock, kill=killed.append,
                   hang_timeout_s=hang_timeout_s, stamps=lambda server_pid: dict(stamps), queues=lambda: dict(queues),
                   wall=lambda: wall[0])
    dog.arm(SERVER)
    return dog, stubs, clock, control, killed, lines, wall, stamps, queues


def test_a_text_model_in_one_execute_past_the_hang_timeout_has_its_stub_killed():
    dog, stubs, clock, control, killed, lines, wall, stamps, _ = text_model_watchdog()
    stamps["preprocessing_0_0"] = (wall[0] - 29.0, 21)  # in one execute, not yet past the timeout
    stamps["postprocessing_0_0"] = (wall[0] - 500.0, 99)  # no such stub (a model of another server)
    dog.tick()
    assert killed == []
    stamps["preprocessing_0_0"] = (wall[0] - 30.0, 77)  # a stamp another process wrote (the old stub's)
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()
    assert killed == []
    stamps["preprocessing_0_0"] = (wall[0] - 31.0, 21)
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()
    assert killed == [21] and "preprocessing_0_0 has been in one execute for 31 s (hung)" in lines[-1]
    assert 'specdec_model_execute_hangs_total{model="preprocessing"} 1' in dog.metrics_text()
    stubs.kill("preprocessing_0_0")  # what the kill does; the next look heals it in place
    clock.now += watchdog.STALL_LOOK_S
    dog.tick()
    assert ("preprocessing", 1) in control.reloads
    off, stubs, clock, _, killed, _, wall, stamps, _ = text_model_watchdog(hang_timeout_s=0)
    stamps["preprocessing_0_0"] = (wall[0] - 1e6, 21)
    off.tick()
    assert killed == []  # 0: never


def test_a_text_model_with_requests_pending_and_no_execution_has_its_stubs_killed():
    """A stub blocked before any execute stamps nothing; Triton's counters show it: requests pending while
    the model's executions stand still. Language models (no stamps) are not judged so."""
    dog, stubs, clock, control, killed, lines, _, _, queues = text_model_watchdog()
    queues.update({"preprocessing": (3.0, 40.0), "target_model": (5.0, 9.0)})
    dog.tick()  # the clock starts
    clock.now += 20
    queues["preprocessing"] = (4.0, 41.0)  # it executes: the clock starts again
    dog.tick()
    clock.now += 29
    dog.tick()
    assert killed == []
    queues["preprocessing"] = (0.0, 41.0)  # nothing pending: idle, not hung
    clock.now += 60
    dog.tick()
    assert killed == []
    clock.now += 6  # requests arrive between two looks: their clock starts at the look that finds them
    queues["preprocessing"] = (2.0, 41.0)
    dog.tick()
    clock.now += 24  # 30 s after the last idle look, 24 after the first that found them waiting
    dog.tick()
    assert killed == []
    clock.now += 6
    dog.tick()
    assert killed == [21] and "preprocessing has had 2 request(s) pending and executed none for 30 s (hung)" in lines[-1]
    assert 'specdec_model_execute_hangs_total{model="preprocessing"} 1' in dog.metrics_text()
    assert 11 not in killed  # target_model's own pending requests are the call timeout's business


def test_the_regions_of_dead_stubs_the_server_still_maps_are_counted_as_stranded():
    """A stub killed serving requests leaves its instance and shared-memory region in Triton 24.10 (found with
    SIGKILLed stubs): the regions the server maps of stubs gone are gauged, the live stubs' and files that are
    no stub's are not."""
    mapped = {"shm-a": 4096, "shm-b": 8192, "unrelated": 1}
    stubs, clock = Stubs(), Clock()
    dog = Watchdog(PORT, Control(stubs), log=lambda _: None, stubs=stubs, clock=clock, kill=lambda pid: None,
                   mapped=lambda pid: {**mapped, **{stub.shm: 10 for stub in stubs(pid) if stub.shm}})
    dog.arm(SERVER)
    assert dog.stranded() == {} and "specdec_stranded_shm_regions 0" in dog.metrics_text()
    stubs.kill("target_model_0_0")
    clock.now += 0.5
    dog.tick()  # reloaded: a new stub, a new region; the old one still mapped by the server
    assert dog.stranded() == {"shm-a": 4096}
    assert dog.stranded_versions() == 1  # what the server's stop cannot unload
    text = dog.metrics_text()
    assert "specdec_stranded_shm_regions 1" in text and "specdec_stranded_shm_bytes 4096" in text
    del mapped["shm-a"]  # an idle stub's region: released with its instance
    assert dog.stranded() == {} and dog.stranded_versions() == 0
    mapped["shm-a"] = 4096
    stubs.server = SERVER + 1
    dog.arm(SERVER + 1)  # a new server holds nothing of the old one's
    assert dog.stranded_versions() == 0


def test_the_shared_memory_a_process_maps_is_read_from_proc(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (proc / "77").mkdir(parents=True)
    (shm / "region_a").write_bytes(b"x" * 10000)
    (proc / "77" / "maps").write_text(
        f"7f0000000000-7f0000100000 rw-s 00000000 00:1a 12 {shm}/region_a\n"
        f"7f0000100000-7f0000200000 rw-s 00000000 00:1a 12 {shm}/region_a\n"  # grown: mapped again
        f"7f0000200000-7f0000300000 rw-s 00000000 00:1a 13 {shm}/region b (deleted)\n"
        "7f0000300000-7f0000400000 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n"
        "7f0000400000-7f0000401000 rw-p 00000000 00:00 0\n")
    found = watchdog.shm_mapped(77, proc, shm)
    assert set(found) == {"region_a", "region b"}
    assert found["region_a"] >= 10000 and found["region b"] == 0
