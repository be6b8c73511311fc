"""Chaos on a server of its own (tiny pair): a model's stub is SIGKILLed under 4 concurrent streams, as the
kernel's OOM killer or a crashing kernel would, or tritonserver itself aborts (SIGABRT, as an uncaught C++
exception in a backend's thread does). No request hangs; the launcher's readiness says not ready, naming
the model, then ready again within 30 s (plus a server's start where the server is restarted); afterwards
requests give the same greedy text as before, speculation drafts again, and nothing the dead stub's
sequences held stays counted (watchdog.py, server_process.py)."""

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from specdec import tensor_names as tn
from specdec.serving import pairs, repository
from specdec.serving.metrics_text import sum_samples
from specdec.serving.server_process import FATAL_EXIT_GRACE_S
from specdec.serving import watchdog
from specdec.serving.watchdog import SERVER

from tests.http_get import get
from tests.polling import wait_for
from .helpers import GenerationError, grpc_stream, retire_server, start_server, stub_processes

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there, how are you today?", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = dict(max_tokens=24, num_draft_tokens=3, adaptive_draft=False, draft_model=tn.DRAFT_MODEL_NAME)
HEALED_WITHIN_S = 30  # a model reloaded in place; a restarted server gets its own first start's time on top
CALL_TIMEOUT_S = 5  # model_call_timeout_s here: far above any call of the tiny pair's, even on a loaded machine
HANG_TIMEOUT_S = 10  # the launcher's --hang-timeout here: an orchestrator's loop turns every tn.HEARTBEAT_S


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("healing")
    started_at = time.monotonic()
    repo = repository.render(pairs.tiny_pair(), tmp_path / "repo")
    repository.override(repo, f"{tn.SPECULATIVE_DECODING}.model_call_timeout_s={CALL_TIMEOUT_S}")
    server = start_server(tmp_path, repository=repo, launcher_args=("--hang-timeout", str(HANG_TIMEOUT_S)))
    server.start_s = time.monotonic() - started_at  # what a restart takes again, on this machine and its load
    yield server
    # Triton never finishes unloading the old instance of a model whose stub died with requests in
    # flight (their state is lost with the stub): its own stop would end only at its exit timeout, with
    # code 1; the launcher ends it once only those are left, a clean stop (docs/deployment.md, "Self-healing").
    retire_server(server)


@pytest.fixture(scope="module")
def before(srv):
    return [grpc_stream(srv.grpc_url, p, **GREEDY)[tn.TEXT_OUTPUT] for p in PROMPTS]


def launcher_metric(srv, name: str, **labels) -> float:
    return sum_samples(get(f"http://127.0.0.1:{srv.health_port}/metrics")[1], name, **labels)


def stub_pid(srv, instance: str) -> int:
    if instance == SERVER:
        lines = [line for line in subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True,
                                                 text=True).stdout.splitlines()
                 if "bin/tritonserver " in line and str(srv.run_dir) in line]
        assert len(lines) == 1, lines
        return int(lines[0].split()[0])
    lines = [line for line in stub_processes(srv.run_dir) if f" {instance} " in f"{line} "]
    assert len(lines) == 1, lines
    return int(lines[0].split()[0])


def start_streams(srv) -> tuple[list[threading.Thread], dict[int, object]]:
    """4 greedy streams of 400 tokens on threads, generating once this returns; what each got lands in the
    dict (its outputs, or the exception) when it ends."""
    outcomes: dict[int, object] = {}

    def stream(i: int) -> None:
        try:
            outcomes[i] = grpc_stream(srv.grpc_url, PROMPTS[i], timeout=90, max_tokens=400, num_draft_tokens=3,
                                      adaptive_draft=False, draft_model=tn.DRAFT_MODEL_NAME)
        except Exception as exc:  # noqa: BLE001 - what each stream got is asserted by the caller
            outcomes[i] = exc

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: held(srv)["live"] == 4, 30, "4 streams generating")
    return threads, outcomes


def held(srv) -> dict[str, float]:
    text = srv.metrics()
    return {"live": sum_samples(text, "specdec_live_sequences"), "queued": sum_samples(text, "specdec_queued_requests"),
            **{f"{m} {k}": sum_samples(text, name, model=m) for m in (tn.TARGET_MODEL_NAME, tn.DRAFT_MODEL_NAME)
               for k, name in (("sequences", "specdec_model_live_sequences"), ("kv", "specdec_model_kv_cache_bytes"))}}


def test_the_watchdog_is_told_every_instance_the_server_runs(srv):
    """The watchdog arms with what the server's configs say each Python model runs (ModelControl.instances:
    the repository index and each config, through the launcher's key), not only with the stubs it finds
    running: one that died just as the server turned ready would otherwise never be watched."""
    pid = stub_pid(srv, SERVER)
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    control = watchdog.ModelControl(srv.http_port, watchdog.restricted_header(args))
    running: dict[str, set[str]] = {}
    for stub in watchdog.stubs_of(pid):
        running.setdefault(stub.model, set()).add(stub.instance)
    assert control.instances() == running
    assert running[tn.SPECULATIVE_DECODING] == {f"{tn.SPECULATIVE_DECODING}_0_0", f"{tn.SPECULATIVE_DECODING}_0_1"}


@pytest.mark.parametrize("instance", [f"{tn.TARGET_MODEL_NAME}_0_0", f"{tn.DRAFT_MODEL_NAME}_0_0",
                                      f"{tn.SPECULATIVE_DECODING}_0_0", SERVER])
def test_a_killed_stub_is_brought_back(srv, before, instance):
    model = instance.rsplit("_", 2)[0]
    restarts = launcher_metric(srv, "specdec_model_restarts_total", model=model)
    server_restarts = launcher_metric(srv, "specdec_server_restarts_total")
    crashes = launcher_metric(srv, "specdec_server_crashes_total")
    threads, outcomes = start_streams(srv)
    killed_at = time.monotonic()
    os.kill(stub_pid(srv, instance), signal.SIGABRT if instance == SERVER else signal.SIGKILL)

    # Readiness drops, naming the model (its first word may be another check's that sees the same failure
    # before the watchdog's next look: Triton's readiness, the OpenAI API's); then it comes back.
    wait_for(lambda: (lambda r: r[0] == 503 and model in r[1])(get(srv.readiness_url)), 10,
             f"readiness says not ready, naming {model}")
    noticed_s = time.monotonic() - killed_at
    wait_for(lambda: get(srv.readiness_url)[0] == 200, HEALED_WITHIN_S + srv.start_s + FATAL_EXIT_GRACE_S,
             f"ready again after {instance} was killed")
    ready_s = time.monotonic() - killed_at
    # Triton itself may abort when a stub dies in the middle of a message (an uncaught lock_exception in its
    # Python backend, seen once in CI): the launcher then restarts the server, whose exit may hang.
    server_crashed = launcher_metric(srv, "specdec_server_crashes_total") > crashes
    assert server_crashed or model != SERVER
    # A decoupled model's dead stub restarts the whole server (the watchdog's log says so, checked below).
    restarted = model in (tn.SPECULATIVE_DECODING, SERVER) or server_crashed
    assert ready_s < HEALED_WITHIN_S + (srv.start_s + FATAL_EXIT_GRACE_S if restarted else 0)
    print(f"\n{instance} killed: not ready after {noticed_s:.1f} s, ready again after {ready_s:.1f} s"
          + ("; tritonserver crashed too" if server_crashed and model != SERVER else ""))

    # No request hangs: each ended, and those that failed say they may be retried.
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a stream still hangs after the heal"
    failures = [o for o in outcomes.values() if isinstance(o, Exception)]
    assert all(isinstance(o, GenerationError) for o in failures), failures
    if server_crashed and model != SERVER:
        pass  # whatever the dead stub's requests got, the server's end ended the others (UNAVAILABLE)
    elif model == tn.DRAFT_MODEL_NAME:
        assert not failures, failures  # the rounds went target-only meanwhile
    elif model == tn.TARGET_MODEL_NAME:  # each says it may be retried (a stream's error carries no code)
        assert len(failures) == 4, outcomes
        assert all(tn.MODEL_DOWN in str(f) for f in failures), failures
    elif model == tn.SPECULATIVE_DECODING:  # the dead instance's streams end with the old server
        assert failures and all(f.status == "StatusCode.UNAVAILABLE" for f in failures), \
            [(f.status, str(f)) for f in failures]
    elif model == SERVER:  # every stream ends with the server
        assert len(failures) == 4 and all(f.status == "StatusCode.UNAVAILABLE" for f in failures), \
            [(f.status, str(f)) for f in failures]

    # Served as before, speculation included, and nothing held for the dead stub's sequences.
    assert [grpc_stream(srv.grpc_url, p, **GREEDY)[tn.TEXT_OUTPUT] for p in PROMPTS] == before
    wait_for(lambda: grpc_stream(srv.grpc_url, PROMPTS[3], **GREEDY)[tn.TOTAL_DRAFT_TOKENS] > 0, HEALED_WITHIN_S,
             "the draft drafts again")
    wait_for(lambda: not any(held(srv).values()), 10, f"nothing held: {held(srv)}")
    if server_crashed and model != SERVER:
        assert launcher_metric(srv, "specdec_server_restarts_total") >= server_restarts + 1
    elif model in (tn.SPECULATIVE_DECODING, SERVER):  # a decoupled model's dead stub, or the server: restarted
        assert launcher_metric(srv, "specdec_server_restarts_total") == server_restarts + 1
    else:
        assert launcher_metric(srv, "specdec_model_restarts_total", model=model) == restarts + 1
    if model != SERVER and not server_crashed:
        assert launcher_metric(srv, "specdec_model_up", model=model) == 1
        assert launcher_metric(srv, "specdec_model_down_seconds_total", model=model) > 0
    assert get(f"http://127.0.0.1:{srv.health_port}/live")[0] == 200


class Frozen:
    """A process held still by ptrace (PTRACE_SEIZE, then PTRACE_INTERRUPT): it runs no instruction, yet /proc
    shows it traced (`t`), neither dead nor stopped by a signal — how a deadlocked stub looks to the watchdog.
    Its main thread (where a model's execute runs), or every thread (an async model's event loop runs on a
    thread of the stub's own; Triton's health checks of the stub then go unanswered too)."""

    SEIZE, INTERRUPT, DETACH = 0x4206, 0x4207, 17

    def __init__(self, pid: int, every_thread: bool = False):
        self.pid, self.libc = pid, ctypes.CDLL(None, use_errno=True)
        self.threads = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task")) if every_thread else [pid]
        for tid in self.threads:
            if self.libc.ptrace(self.SEIZE, tid, None, None) != 0:
                errno = ctypes.get_errno()
                self.end()
                pytest.skip(f"ptrace is not permitted here (errno {errno})")
            assert self.libc.ptrace(self.INTERRUPT, tid, None, None) == 0, ctypes.get_errno()

    def dead(self) -> bool:
        """Killed (a zombie its tracer has not reaped yet) or gone."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] in watchdog.DEAD_STATES

    def end(self) -> None:
        """Let it go: reap its threads' deaths as their tracer (its parent cannot until then), or detach."""
        for tid in self.threads:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(tid, os.WNOHANG | 0x40000000)  # __WALL
            self.libc.ptrace(self.DETACH, tid, None, 0)


def test_a_hung_target_model_is_killed_and_brought_back(srv, before):
    """target_model's stub hangs (frozen by ptrace under 4 streams): each stream fails once its call has waited
    model_call_timeout_s, the orchestrator counts it, the watchdog kills the stub, and the model is reloaded."""
    timeouts = srv.metric(tn.MODEL_CALL_TIMEOUTS, model=tn.TARGET_MODEL_NAME)
    restarts = launcher_metric(srv, "specdec_model_restarts_total", model=tn.TARGET_MODEL_NAME)
    threads, outcomes = start_streams(srv)
    frozen = Frozen(stub_pid(srv, f"{tn.TARGET_MODEL_NAME}_0_0"))
    frozen_at = time.monotonic()
    try:
        for thread in threads:
            thread.join(timeout=CALL_TIMEOUT_S + 30)
        failed_s = time.monotonic() - frozen_at
        assert not any(thread.is_alive() for thread in threads), "a stream still hangs on the frozen model"
        assert len(outcomes) == 4 and all(isinstance(o, GenerationError) and tn.MODEL_DOWN in str(o)
                                          for o in outcomes.values()), outcomes
        # They failed by the timeout, not sooner: the call a stream had in flight when the stub froze started
        # up to a round before `frozen_at` (seen: 4.999 s), so a second's slack below, far above a round here.
        assert CALL_TIMEOUT_S - 1 <= failed_s < CALL_TIMEOUT_S + 30
        wait_for(lambda: (lambda r: r[0] == 503 and tn.TARGET_MODEL_NAME in r[1])(get(srv.readiness_url)),
                 watchdog.STALL_LOOK_S + 10, "readiness names target_model")
    finally:
        frozen.end()
    wait_for(lambda: get(srv.readiness_url)[0] == 200, HEALED_WITHIN_S, "ready again after the hung model")
    print(f"\ntarget_model frozen: streams failed after {failed_s:.1f} s, "
          f"ready again after {time.monotonic() - frozen_at:.1f} s")
    assert srv.metric(tn.MODEL_CALL_TIMEOUTS, model=tn.TARGET_MODEL_NAME) > timeouts
    assert launcher_metric(srv, "specdec_model_restarts_total", model=tn.TARGET_MODEL_NAME) == restarts + 1
    assert [grpc_stream(srv.grpc_url, p, **GREEDY)[tn.TEXT_OUTPUT] for p in PROMPTS] == before
    wait_for(lambda: not any(held(srv).values()), 10, f"nothing held: {held(srv)}")


def test_a_text_model_in_one_execute_past_the_hang_timeout_is_killed_and_reloaded(srv, before):
    """preprocessing's instance stamps each execute (triton/execute_clock.py): its file says idle (0.0) and
    its stub's pid after the requests above. A stamp as a stub stuck in a tokenizer call leaves it (planted:
    no request can be held inside a real execute on cue) gets that stub killed past --hang-timeout and the
    model reloaded in place; the new stub's file says idle, and the server serves the same text."""
    from specdec.triton import execute_clock

    instance = f"{tn.PREPROCESSING}_0_0"
    server_pid = stub_pid(srv, SERVER)
    directory = execute_clock.default_directory(server_pid)
    pid = stub_pid(srv, instance)
    assert execute_clock.stamps(directory)[instance] == (0.0, pid)
    restarts = launcher_metric(srv, "specdec_model_restarts_total", model=tn.PREPROCESSING)
    (directory / instance).write_bytes(execute_clock.STAMP.pack(time.time() - HANG_TIMEOUT_S, pid))
    wait_for(lambda: pid not in {stub.pid for stub in watchdog.stubs_of(server_pid)
                                 if stub.state not in watchdog.DEAD_STATES},
             2 * watchdog.STALL_LOOK_S + 5, "the stuck stub killed")
    wait_for(lambda: launcher_metric(srv, "specdec_model_restarts_total", model=tn.PREPROCESSING) == restarts + 1
             and get(srv.readiness_url)[0] == 200, HEALED_WITHIN_S, "preprocessing reloaded")
    assert launcher_metric(srv, "specdec_model_execute_hangs_total", model=tn.PREPROCESSING) >= 1
    assert [grpc_stream(srv.grpc_url, p, **GREEDY)[tn.TEXT_OUTPUT] for p in PROMPTS] == before
    assert execute_clock.STAMP.unpack((directory / instance).read_bytes()) == (0.0, stub_pid(srv, instance))


def test_a_text_model_blocked_before_its_execute_is_killed_and_reloaded(srv, before):
    """preprocessing's stub frozen (ptrace) while idle: it stamps no execute, but requests queue at it while
    it executes none (Triton's pending-request and execution counters); past --hang-timeout the watchdog
    kills it and reloads it in place, the requests sent meanwhile end, and the server serves the same text."""
    hangs = launcher_metric(srv, "specdec_model_execute_hangs_total", model=tn.PREPROCESSING)
    restarts = launcher_metric(srv, "specdec_model_restarts_total", model=tn.PREPROCESSING)
    frozen = Frozen(stub_pid(srv, f"{tn.PREPROCESSING}_0_0"))
    frozen_at = time.monotonic()
    outcomes: dict[int, object] = {}

    def request(i: int) -> None:
        try:
            outcomes[i] = grpc_stream(srv.grpc_url, PROMPTS[i], timeout=90, **GREEDY)
        except Exception as exc:  # noqa: BLE001 - served or refused: either ends it
            outcomes[i] = exc

    threads = [threading.Thread(target=request, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: launcher_metric(srv, "specdec_model_execute_hangs_total", model=tn.PREPROCESSING) > hangs,
                 HANG_TIMEOUT_S + 2 * watchdog.STALL_LOOK_S + 10, "preprocessing judged hung")
        noticed_s = time.monotonic() - frozen_at
        assert noticed_s >= HANG_TIMEOUT_S
    finally:
        frozen.end()
    wait_for(lambda: launcher_metric(srv, "specdec_model_restarts_total", model=tn.PREPROCESSING) == restarts + 1
             and get(srv.readiness_url)[0] == 200, HEALED_WITHIN_S, "preprocessing reloaded")
    print(f"\npreprocessing frozen: judged hung after {noticed_s:.1f} s, "
          f"ready again after {time.monotonic() - frozen_at:.1f} s; the requests meanwhile: "
          f"{sorted(type(o).__name__ for o in outcomes.values())}")
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a request still hangs after the reload"
    assert [grpc_stream(srv.grpc_url, p, **GREEDY)[tn.TEXT_OUTPUT] for p in PROMPTS] == before


def test_a_hung_orchestrator_is_killed_and_the_server_restarted(srv, before):
    """Both orchestrator instances hang (frozen by ptrace under 4 streams): their event loops stop counting
    turns while their requests generate; past --hang-timeout the watchdog kills their stubs, the server is
    restarted, the streams end UNAVAILABLE with the old one, and the new one serves the same text."""
    hangs = launcher_metric(srv, "specdec_orchestrator_hangs_total")
    server_restarts = launcher_metric(srv, "specdec_server_restarts_total")
    threads, outcomes = start_streams(srv)
    frozen = [Frozen(stub_pid(srv, f"{tn.SPECULATIVE_DECODING}_0_{i}"), every_thread=True) for i in range(2)]
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: (lambda r: r[0] == 503 and tn.SPECULATIVE_DECODING in r[1])(get(srv.readiness_url)),
                 HANG_TIMEOUT_S + 2 * watchdog.STALL_LOOK_S + 10, "readiness names speculative_decoding")
        noticed_s = time.monotonic() - frozen_at
        # Not before its time: the loop's last counted turn may precede the freeze by a heartbeat
        assert noticed_s >= HANG_TIMEOUT_S - tn.HEARTBEAT_S
        # Released before it is killed, an instance would run on and fail its streams itself (its call to
        # target_model, frozen with it, has waited past model_call_timeout_s): hung means hung until killed.
        wait_for(lambda: all(process.dead() for process in frozen), HEALED_WITHIN_S, "both orchestrators killed")
    finally:
        for process in frozen:
            process.end()
    wait_for(lambda: get(srv.readiness_url)[0] == 200, HEALED_WITHIN_S + srv.start_s, "ready again")
    ready_s = time.monotonic() - frozen_at
    print(f"\norchestrators frozen: not ready after {noticed_s:.1f} s, ready again after {ready_s:.1f} s")
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a stream still hangs after the restart"
    failures = [o for o in outcomes.values() if isinstance(o, Exception)]
    assert len(failures) == 4 and all(isinstance(f, GenerationError) and f.status == "StatusCode.UNAVAILABLE"
                                      for f in failures), outcomes
    assert launcher_metric(srv, "specdec_orchestrator_hangs_total") >= hangs + 1
    assert launcher_metric(srv, "specdec_server_restarts_total") == server_restarts + 1
    assert [grpc_stream(srv.grpc_url, p, **GREEDY)[tn.TEXT_OUTPUT] for p in PROMPTS] == before
    wait_for(lambda: not any(held(srv).values()), 10, f"nothing held: {held(srv)}")
