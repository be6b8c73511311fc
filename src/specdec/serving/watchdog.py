"""The launcher's watchdog: a model whose stub process dies is noticed within a second and brought back.

Triton 2.51's Python backend never restarts a dead stub: from then on every request to that model fails
("Stub process ... is not healthy") while Triton's readiness keeps answering 200. The watchdog
(a thread of the launcher) looks at tritonserver's child processes once a `period_s` (/proc: about a
millisecond) and compares each model's stub instances with the ones it saw when the model came up:

- **Detect**: a stub that is gone, a zombie, or stopped (SIGSTOP) for longer than `STOPPED_GRACE_S`
  marks its model down: readiness drops at once, naming it (the down marker, healthcheck.py).
- **Heal in place** where the server runs with explicit model control and the model is not decoupled
  (target_model, draft_model, pre/postprocessing): the model is loaded again with its own configuration
  (`ModelControl.reload`: a load request whose config override carries one more parameter,
  `specdec_incarnation`, so that Triton builds new instances; a plain load of an unchanged model
  does nothing). Its caches start empty; the orchestrator drops the sequences it held there as their
  requests fail, and a draft rejoins rotation at its fallback's next probe.
- **Restart the server** otherwise: a decoupled model's dead stub (speculative_decoding) leaves the
  streams it was serving open forever (the backend never completes their responses, and the old
  instance never finishes unloading), and without explicit model control nothing can be reloaded. The
  launcher then lets the healthy instances' streams finish (at most its drain timeout) and starts
  tritonserver again; the hung streams end with the old server.
- **The server itself crashed** (it exited, or reported a fatal signal and did not exit:
  server_process.py): the launcher tells `server_down` and starts it again; readiness names it meanwhile.
- **A model that hangs** while its process runs (a deadlock, a stuck device: nothing /proc shows): the
  orchestrator fails a call that model has not answered within `model_call_timeout_s` and counts it
  (`specdec_model_call_timeouts_total{model}`, bls.py); the watchdog reads that counter from the server's
  metrics every `STALL_LOOK_S` and kills the model's stubs when it grows, and the model is healed as
  above. **An orchestrator that hangs** (its event loop blocked: a call that never returns, a deadlock):
  each instance counts its loop's turns (`specdec_orchestrator_heartbeats_total{instance}`, one a second);
  read with the counter above, an instance with requests generating whose count has not moved for
  `hang_timeout_s` has its stub killed, and the server is restarted as for any dead orchestrator. **A
  text model that hangs** (preprocessing, postprocessing: ensemble steps no orchestrator calls): each
  instance stamps since when its current execute runs (triton/execute_clock.py); one in the same execute
  for `hang_timeout_s` has its stub killed, and the model is reloaded in place; so are the stubs of a text
  model with requests pending (Triton's `nv_inference_pending_request_count`) whose executions
  (`nv_inference_exec_count`) have not moved for as long (a stub blocked before any execute).
- **Back off**: a model that dies again within `STABLE_S` of its last heal waits 1, 2, 4 ... 60 s
  between attempts; a failed reload too; a server that crashes again within `STABLE_S` of its restart
  likewise. **Liveness** fails once a model, or the server, has been down for longer than
  `heal_timeout_s`, so Kubernetes restarts the pod.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.serving.healthcheck import down_marker

STUB_BINARY = "triton_python_backend_stub"
STOPPED_GRACE_S = 5.0  # a stub stopped this long counts as not answering (a debugger's pause is shorter)
STALL_LOOK_S = 5.0  # how often the server's metrics are read for calls a model left unanswered (~3 ms a read)
# An orchestrator's event loop not turning this long with requests generating is hung: far above any pause of a
# healthy loop (a round's host work takes milliseconds; large guides compile on a thread)
DEFAULT_HANG_TIMEOUT_S = 60.0
STABLE_S = 60.0  # a model up this long after a heal starts its backoff afresh when it dies again
BACKOFF_S = (1.0, 60.0)  # first and longest wait between heal attempts of one model
SERVER = "tritonserver"  # how readiness and liveness name the server itself when it is down
INCARNATION = "specdec_incarnation"  # the config parameter a reload changes (models ignore it)
DEAD_STATES = ("Z", "X")  # /proc/PID/stat states of a process that has exited (zombie, dead)


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str
    instance: str  # Triton's instance name, e.g. target_model_0_0
    state: str  # /proc's: R, S, D, T (stopped), Z (zombie) ...
    shm: str = ""  # its shared-memory region's name (/dev/shm), which a killed server leaves behind


def stubs_of(server_pid: int, proc: Path = Path("/proc")) -> list[Stub]:
    """The Python-backend stub processes tritonserver `server_pid` runs (its children), read from /proc.
    A stub's arguments are `stub MODEL_DIR/VERSION/model.py SHM SIZE GROWTH PARENT LIBDIR IPC INSTANCE ...`."""
    found = []
    root = str(proc)
    for name in os.listdir(root):
        if not name.isdigit():
            continue
        try:
            with open(f"{root}/{name}/stat", "rb") as file:
                stat = file.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
            fields = stat[stat.rindex(b")") + 2:].split(None, 2)
            if int(fields[1]) != server_pid:
                continue
            with open(f"{root}/{name}/cmdline", "rb") as file:
                args = file.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if len(args) < 9 or not args[0].endswith(STUB_BINARY.encode()):
            continue
        model = Path(args[1].decode()).parent.parent.name
        found.append(Stub(int(name), model, args[8].decode(), fields[0].decode(), args[2].decode()))
    return found


def shm_mapped(server_pid: int, proc: Path = Path("/proc"), shm_dir: Path = Path("/dev/shm")) -> dict[str, int]:
    """The files of `shm_dir` that process `server_pid` maps, by name, with the memory each holds (its allocated
    bytes; 0 for one unlinked meanwhile). A region grown is mapped again: each name counts once."""
    found: dict[str, int] = {}
    prefix = f"{shm_dir}/"
    with open(proc / str(server_pid) / "maps") as maps:
        for line in maps:
            fields = line.rstrip("\n").split(None, 5)
            if len(fields) < 6 or not fields[5].startswith(prefix):
                continue
            name = fields[5][len(prefix):].removesuffix(" (deleted)")
            if name not in found:
                try:
                    found[name] = (shm_dir / name).stat().st_blocks * 512
                except OSError:
                    found[name] = 0
    return found


class ModelControl:
    """Triton's model repository API (HTTP), with the restricted-API header where the server demands one."""

    def __init__(self, http_port: int, header: tuple[str, str] | None = None, timeout_s: float = 600.0):
        self.base = f"http://127.0.0.1:{http_port}/v2"
        self.header, self.timeout_s = header, timeout_s

    def _call(self, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(self.base + path, data=None if body is None else json.dumps(body).encode(),
                                         method="GET" if body is None else "POST")
        if self.header:
            request.add_header(*self.header)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"{path}: HTTP {exc.code} {detail.strip()[:300]}") from None
        return json.loads(text) if text.strip() else {}

    def config(self, model: str) -> dict:
        return self._call(f"/models/{model}/config")

    def decoupled(self, model: str) -> bool:
        return bool(self.config(model).get("model_transaction_policy", {}).get("decoupled", False))

    def instances(self) -> dict[str, set[str]]:
        """The instances (one stub each) of every loaded Python-backend model, from Triton's repository index
        and the models' configs: an instance group `G` of count `n` runs `G_0` .. `G_{n-1}`."""
        found: dict[str, set[str]] = {}
        for entry in self._call("/repository/index", {}):
            if entry.get("state") != "READY" or entry["name"] in found:
                continue
            config = self.config(entry["name"])
            if config.get("backend") == "python":
                found[entry["name"]] = {f"{group['name']}_{i}" for group in config.get("instance_group", [])
                                        for i in range(int(group.get("count", 1)))}
        return found

    def reload(self, model: str, incarnation: int) -> None:
        """Load `model` again with the configuration it runs with: new instances (new stubs) replace the
        old ones. Raises RuntimeError naming the refusal."""
        config = self.config(model)
        config.setdefault("parameters", {})[INCARNATION] = {"string_value": str(incarnation)}
        self._call(f"/repository/models/{model}/load", {"parameters": {"config": json.dumps(config)}})


def restricted_header(server_args: list[str]) -> tuple[str, str] | None:
    """The header the model repository API demands (`--http-restricted-api=model-repository:KEY=VALUE`)."""
    for arg in server_args:
        if arg.startswith("--http-restricted-api="):
            apis, _, pair = arg.split("=", 1)[1].partition(":")
            if "model-repository" in apis.split(",") and "=" in pair:
                key, value = pair.split("=", 1)
                return key, value
    return None


def control_mode(server_args: list[str]) -> str:
    """The model control mode the server runs with (the last --model-control-mode; Triton's default none)."""
    modes = [arg.split("=", 1)[1] for arg in server_args if arg.startswith("--model-control-mode=")]
    return modes[-1] if modes else "none"


@dataclass
class ModelHealth:
    instances: set[str]
    down_since: float | None = None
    reason: str = ""
    attempts: int = 0  # heal attempts since it went down (with the deaths soon after a heal: the backoff)
    next_try: float = 0.0
    healed_at: float = -1e18
    stopped_since: dict[int, float] = field(default_factory=dict)
    restarts: int = 0
    down_s: float = 0.0  # finished down periods


class Watchdog:
    """See the module's docstring. `tick` is one look (the thread calls it every period_s); the launcher
    calls `arm` once the server is ready and after each restart, and restarts the server when
    `restart_wanted` is set."""

    def __init__(self, http_port: int, control: ModelControl | None, heal_timeout_s: float = 300.0,
                 period_s: float = 1.0, log: Callable[[str], None] = print,
                 stubs: Callable[[int], list[Stub]] = stubs_of, clock: Callable[[], float] = time.monotonic,
                 kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL),
                 stalls: Callable[[], dict[str, float]] | None = None,
                 heartbeats: Callable[[], dict[str, tuple[float, float]]] | None = None,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 stamps: Callable[[int], dict[str, tuple[float, int]]] | None = None,
                 queues: Callable[[], dict[str, tuple[float, float]]] | None = None,
                 wall: Callable[[], float] = time.time, mapped: Callable[[int], dict[str, int]] = shm_mapped):
        self.marker = down_marker(http_port)
        self.control, self.heal_timeout_s, self.period_s = control, heal_timeout_s, period_s
        self.log, self.stubs, self.clock, self.kill = log, stubs, clock, kill
        # The orchestrator's count of unanswered calls per model (tn.MODEL_CALL_TIMEOUTS), read from the server
        self.stalls = stalls
        self._stalls_seen: dict[str, float] = {}
        # Per orchestrator instance (its stub's instance name): its event loop's turns and its requests
        # generating (tn.ORCHESTRATOR_HEARTBEATS, tn.LIVE_SEQUENCES); an instance generating whose count stays
        # put for hang_timeout_s (0: never) is hung. _beats_seen: the count and when it last moved.
        self.heartbeats, self.hang_timeout_s = heartbeats, hang_timeout_s
        self._beats_seen: dict[str, tuple[float, float]] = {}
        self.orchestrator_hangs = 0
        # Per text-model instance of the server (its pid): since when (wall clock) its current execute runs
        # (0.0: none) and its stub's pid (triton/execute_clock.py); one running for hang_timeout_s is hung.
        # Per model, Triton's requests pending and executions done (`queues`): a text model with requests
        # pending that executes none for hang_timeout_s is hung too (a stub blocked before any execute).
        self.stamps, self.queues, self.wall = stamps, queues, wall
        self._queues_seen: dict[str, tuple[float, float]] = {}  # executions, and since when they stood still
        self.execute_hangs: dict[str, int] = {}
        self._next_stall_look = 0.0
        self.models: dict[str, ModelHealth] = {}
        self.regions: set[str] = set()  # the stubs' shared-memory regions seen (removed once the server is gone)
        self.mapped = mapped  # the shared-memory files a server maps, with their bytes (see `stranded`)
        self._model_regions: dict[str, set[str]] = {}  # each model's current stubs' regions
        self._retired: list[set[str]] = []  # the regions of each instance set a reload replaced, one per reload
        self.server_pid = 0
        self.server_restarts = 0
        self.server = ModelHealth(set())  # tritonserver's own crashes (down while the launcher restarts it)
        self.server_crashes = 0
        self.restart_wanted = threading.Event()
        self._decoupled: dict[str, bool] = {}
        self._incarnation = 0  # reloads asked of this server
        self._lock = threading.Lock()  # tick (its thread) against the endpoint's reads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.marker.unlink(missing_ok=True)

    # ---- the server's life -------------------------------------------------------------------------
    def arm(self, server_pid: int) -> None:
        """Watch the stubs of this (ready) server: the instances its models run (asked of the server, where
        there is model control) and those found running; what went down before is up again."""
        seen: dict[str, set[str]] = {}
        if server_pid != self.server_pid:  # a new server: what the old one held went with it
            self._model_regions.clear()
            self._retired.clear()
        for stub in self.stubs(server_pid):
            seen.setdefault(stub.model, set()).add(stub.instance)
            self.regions.add(stub.shm)
            if stub.shm:
                self._model_regions.setdefault(stub.model, set()).add(stub.shm)
        # A stub that died between the server's readiness and this look is in no list of running ones, and
        # would never be watched: seen once, a stub killed just as its server turned ready (the launcher
        # notices readiness up to half a second after a client can).
        if self.control is not None:
            try:
                for model, instances in self.control.instances().items():
                    seen.setdefault(model, set()).update(instances)
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
                self.log(f"watchdog: the server's models could not be listed ({exc}); watching the stubs running")
        now = self.clock()
        with self._lock:
            if server_pid != self.server_pid and self.server_pid:
                self.server_restarts += 1
                self._incarnation = 0
            self.server_pid = server_pid
            self._stalls_seen.clear()  # a new server counts from 0
            self._beats_seen.clear()
            self._queues_seen.clear()
            if self.server.down_since is not None:
                self._up(SERVER, self.server, now)
            for model, instances in seen.items():
                health = self.models.setdefault(model, ModelHealth(instances))
                health.instances = instances
                if health.down_since is not None:
                    self._up(model, health, now)
            self.restart_wanted.clear()
            self._write_marker()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="stub-watchdog")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.marker.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the watchdog outlives whatever one look hits
                self.log(f"watchdog: {exc}")

    def server_down(self, reason: str) -> float:
        """The server crashed (`reason`): readiness names it and the looks pause until the launcher's restart
        `arm`s again. Returns the seconds to wait before that restart (the backoff)."""
        now = self.clock()
        with self._lock:
            health = self.server
            if now - health.healed_at > STABLE_S:
                health.attempts = 0
            health.down_since, health.reason = now, reason
            health.attempts += 1
            self.server_crashes += 1
            self.restart_wanted.set()
            self._write_marker()
        return self._backoff(health.attempts - 1)

    # ---- one look ----------------------------------------------------------------------------------
    def tick(self) -> None:
        if not self.server_pid or self.restart_wanted.is_set():
            return
        now = self.clock()
        alive: dict[str, dict[str, Stub]] = {}
        for stub in self.stubs(self.server_pid):
            # An instance's old stub (exiting after a reload, or a zombie not reaped yet) beside its new one:
            # the running one counts.
            seen = alive.setdefault(stub.model, {}).get(stub.instance)
            if seen is None or seen.state in DEAD_STATES:
                alive[stub.model][stub.instance] = stub
        if ((self.stalls is not None or self.heartbeats is not None or self.stamps is not None)
                and now >= self._next_stall_look):
            self._next_stall_look = now + STALL_LOOK_S
            self._kill_stalled(alive)
            self._kill_hung(alive, now)
            self._kill_hung_text_models(alive, now)
        for model, health in list(self.models.items()):
            problem = self._problem(health, alive.get(model, {}), now)
            if problem and health.down_since is None:
                with self._lock:
                    health.down_since, health.reason = now, problem
                    if now - health.healed_at > STABLE_S:
                        health.attempts = 0  # it had stayed up: no backoff
                    health.next_try = now + self._backoff(health.attempts)
                    self._write_marker()
                self.log(f"watchdog: {model} is down: {problem}; "
                         f"healing in {health.next_try - now:.0f} s" if health.attempts else
                         f"watchdog: {model} is down: {problem}; healing")
            if health.down_since is not None and now >= health.next_try:
                self._heal(model, health, alive.get(model, {}))

    def _kill_stalled(self, alive: dict[str, dict[str, Stub]]) -> None:
        """Kill the stubs of every model whose unanswered calls grew since the last read: its death is then
        seen (next look) and healed like any other."""
        if self.stalls is None:
            return
        try:
            counts = self.stalls()
        except (OSError, ValueError):  # the server's metrics do not answer (it is loading, stopping)
            return
        for model, count in counts.items():
            seen, self._stalls_seen[model] = self._stalls_seen.get(model, 0.0), count
            running = [stub for stub in alive.get(model, {}).values() if stub.state not in DEAD_STATES]
            if count > seen and running:
                self.log(f"watchdog: {model} left {count - seen:.0f} call(s) unanswered past the orchestrator's "
                         f"model_call_timeout_s; killing its stubs ({', '.join(str(s.pid) for s in running)})")
                for stub in running:
                    self.kill(stub.pid)

    def _kill_hung(self, alive: dict[str, dict[str, Stub]], now: float) -> None:
        """Kill the stub of every orchestrator instance whose event loop has not turned for hang_timeout_s
        while it had requests generating: a dead decoupled stub, it is healed by restarting the server."""
        if self.heartbeats is None or not self.hang_timeout_s:
            return
        try:
            readings = self.heartbeats()
        except (OSError, ValueError):  # the server's metrics do not answer (it is loading, stopping)
            return
        stubs = {instance: stub for instances in alive.values() for instance, stub in instances.items()}
        for instance, (count, live) in readings.items():
            seen = self._beats_seen.get(instance)
            if live <= 0 or seen is None or count != seen[0]:  # idle, or turning: the clock starts again
                self._beats_seen[instance] = (count, now)
                continue
            stub = stubs.get(instance)
            if now - seen[1] >= self.hang_timeout_s and stub is not None and stub.state not in DEAD_STATES:
                self.log(f"watchdog: {instance}'s event loop has not turned for {now - seen[1]:.0f} s with "
                         f"{live:.0f} request(s) generating (hung); killing its stub ({stub.pid})")
                self.orchestrator_hangs += 1
                self._beats_seen.pop(instance)
                self.kill(stub.pid)

    def _kill_hung_text_models(self, alive: dict[str, dict[str, Stub]], now: float) -> None:
        """Kill the stub of every text-model instance whose current execute has run for hang_timeout_s (a
        tokenizer call that never returns; only the stub that wrote the stamp: a reloaded instance's new
        stub reuses the file), and the stubs of a text model with requests pending that has executed none
        for as long (a stub blocked before any execute). Their deaths are then seen and healed as any."""
        if self.stamps is None or not self.hang_timeout_s:
            return
        wall = self.wall()
        stubs = {instance: stub for instances in alive.values() for instance, stub in instances.items()}
        stamped = self.stamps(self.server_pid)
        for instance, (since, pid) in stamped.items():
            stub = stubs.get(instance)
            if since <= 0 or stub is None or stub.pid != pid or stub.state in DEAD_STATES:
                continue
            if wall - since >= self.hang_timeout_s:
                self._kill_text_model(stub.model, [stub], f"{instance} has been in one execute for "
                                                         f"{wall - since:.0f} s")
        if self.queues is None:
            return
        try:
            queues = self.queues()
        except (OSError, ValueError):  # the server's metrics do not answer (it is loading, stopping)
            return
        for model in sorted({stubs[instance].model for instance in stamped if instance in stubs}):
            pending, executions = queues.get(model, (0.0, 0.0))
            if pending <= 0:  # idle: no clock
                self._queues_seen.pop(model, None)
                continue
            seen = self._queues_seen.get(model)
            # The clock starts at the first look that finds requests pending (not at the last idle look,
            # which may precede their arrival by a look: a kill before hang_timeout_s of waiting), and again
            # whenever the model executes.
            if seen is None or executions != seen[0]:
                self._queues_seen[model] = (executions, now)
                continue
            running = [stub for stub in alive.get(model, {}).values() if stub.state not in DEAD_STATES]
            if now - seen[1] >= self.hang_timeout_s and running:
                self._queues_seen.pop(model)
                self._kill_text_model(model, running, f"{model} has had {pending:.0f} request(s) pending and "
                                                      f"executed none for {now - seen[1]:.0f} s")

    def _kill_text_model(self, model: str, stubs: list[Stub], why: str) -> None:
        self.log(f"watchdog: {why} (hung); killing its stub{'s' if len(stubs) > 1 else ''} "
                 f"({', '.join(str(stub.pid) for stub in stubs)})")
        with self._lock:
            self.execute_hangs[model] = self.execute_hangs.get(model, 0) + 1
        for stub in stubs:
            self.kill(stub.pid)

    def _problem(self, health: ModelHealth, running: dict[str, Stub], now: float) -> str:
        for instance in sorted(health.instances):
            stub = running.get(instance)
            if stub is None or stub.state in DEAD_STATES:
                return f"its stub {instance} died"
            if stub.state == "T":
                since = health.stopped_since.setdefault(stub.pid, now)
                if now - since >= STOPPED_GRACE_S:
                    return f"its stub {instance} (pid {stub.pid}) is stopped"
            else:
                health.stopped_since.pop(stub.pid, None)
        return ""

    def _heal(self, model: str, health: ModelHealth, running: dict[str, Stub]) -> None:
        health.attempts += 1
        if not self._in_place(model):
            self.log(f"watchdog: {model} cannot be reloaded in place; restarting tritonserver")
            self.restart_wanted.set()
            return
        for stub in running.values():  # a stopped stub would hold up its instance's unload
            if stub.state == "T":
                self.kill(stub.pid)
        started = self.clock()
        # The instances this reload replaces: their regions stay mapped if Triton keeps them (`stranded`)
        replaced = self._model_regions.get(model, set()) | {stub.shm for stub in running.values() if stub.shm}
        try:
            self._incarnation += 1
            self.control.reload(model, self._incarnation)
        except (OSError, RuntimeError) as exc:
            health.next_try = self.clock() + self._backoff(health.attempts)
            self.log(f"watchdog: reloading {model} failed ({exc}); next attempt in "
                     f"{health.next_try - self.clock():.0f} s")
            return
        now = self.clock()
        down_for = now - health.down_since
        with self._lock:
            stubs = [stub for stub in self.stubs(self.server_pid) if stub.model == model]
            health.instances = {stub.instance for stub in stubs}
            self.regions.update(stub.shm for stub in stubs)
            self._model_regions[model] = {stub.shm for stub in stubs if stub.shm} - replaced
            if replaced:
                self._retired.append(replaced)
            self._up(model, health, now)
            self._write_marker()
        self.log(f"watchdog: {model} reloaded in {now - started:.1f} s, serving again after {down_for:.1f} s down "
                 f"(restart {health.restarts})")

    def _up(self, model: str, health: ModelHealth, now: float) -> None:
        health.down_s += now - health.down_since
        health.restarts += 1
        health.down_since, health.reason, health.healed_at = None, "", now
        health.stopped_since.clear()

    def _in_place(self, model: str) -> bool:
        if self.control is None:
            return False
        if model not in self._decoupled:
            try:
                self._decoupled[model] = self.control.decoupled(model)
            except (OSError, RuntimeError, ValueError):
                return False
        return not self._decoupled[model]

    @staticmethod
    def _backoff(attempts: int) -> float:
        return 0.0 if attempts == 0 else min(BACKOFF_S[0] * 2 ** (attempts - 1), BACKOFF_S[1])

    def _write_marker(self) -> None:
        down = self.down_now()
        if down:
            staging = self.marker.with_suffix(".new")
            staging.write_text("".join(f"{model}: {reason}\n" for model, reason in down.items()))
            os.replace(staging, self.marker)
        else:
            self.marker.unlink(missing_ok=True)

    # ---- what the endpoint reports -----------------------------------------------------------------
    def down_now(self) -> dict[str, str]:
        return {model: health.reason for model, health in self._watched() if health.down_since is not None}

    def _watched(self) -> list[tuple[str, ModelHealth]]:
        return [*self.models.items(), (SERVER, self.server)]

    def dead_instances(self) -> set[str]:
        """The instances of the models that are down (their gauges are stale)."""
        with self._lock:
            return {i for health in self.models.values() if health.down_since is not None for i in health.instances}

    def live_problem(self) -> str | None:
        """Why liveness fails (a model down for longer than heal_timeout_s), or None."""
        now = self.clock()
        with self._lock:
            for model, health in self._watched():
                if health.down_since is not None and now - health.down_since > self.heal_timeout_s:
                    return (f"{model} has been down for {now - health.down_since:.0f} s (over the heal timeout, "
                            f"{self.heal_timeout_s:.0f} s): {health.reason}")
        return None

    def stranded(self) -> dict[str, int]:
        """The shared-memory regions of stubs gone that the server still maps, with their bytes. Triton 24.10's
        Python backend never releases the requests a stub was serving when it died: the old instance, and its
        region (as large as that stub's traffic grew it), stay until the server stops, whose own stop would wait
        its whole exit timeout for them (found with SIGKILLed stubs: an idle stub's region is freed at its
        reload). The launcher's stop ends it once only those are left (`stranded_versions`)."""
        pid = self.server_pid
        if not pid:
            return {}
        try:
            live = {stub.shm for stub in self.stubs(pid)}
            mapped = self.mapped(pid)
        except OSError:  # the server gone meanwhile
            return {}
        return {name: size for name, size in mapped.items() if name in self.regions and name not in live}

    def stranded_versions(self) -> int:
        """How many model versions the server keeps for good: the instance sets replaced by a reload whose
        regions it still maps (what its stop cannot unload; ServerProcess.stranded_models)."""
        held = self.stranded()
        return sum(1 for regions in self._retired if regions & held.keys())

    def metrics_text(self) -> str:
        """The watchdog's metrics in Prometheus' text format (served on the launcher's HEALTH_PORT)."""
        now = self.clock()
        stranded = self.stranded()
        lines = ["# HELP specdec_model_restarts_total Times the watchdog brought a model back after its stub died",
                 "# TYPE specdec_model_restarts_total counter"]
        with self._lock:
            models = sorted(self.models.items())
            lines += [f'specdec_model_restarts_total{{model="{m}"}} {h.restarts}' for m, h in models]
            lines += ["# HELP specdec_model_down_seconds_total Seconds a model was down (its stub dead, until it "
                      "served again)", "# TYPE specdec_model_down_seconds_total counter"]
            lines += [f'specdec_model_down_seconds_total{{model="{m}"}} '
                      f'{h.down_s + (now - h.down_since if h.down_since is not None else 0.0):.3f}' for m, h in models]
            lines += ["# HELP specdec_model_up Whether the model's stubs are all running (1) or it is down (0)",
                      "# TYPE specdec_model_up gauge"]
            lines += [f'specdec_model_up{{model="{m}"}} {0 if h.down_since is not None else 1}' for m, h in models]
            lines += ["# HELP specdec_server_restarts_total Times the launcher restarted tritonserver (to heal a "
                      "decoupled model, or after the server itself crashed)",
                      "# TYPE specdec_server_restarts_total counter", f"specdec_server_restarts_total {self.server_restarts}"]
            lines += ["# HELP specdec_server_crashes_total Times tritonserver itself crashed while serving (it exited, "
                      "or reported a fatal signal and did not exit)", "# TYPE specdec_server_crashes_total counter",
                      f"specdec_server_crashes_total {self.server_crashes}"]
            lines += ["# HELP specdec_orchestrator_hangs_total Times an orchestrator instance's event loop stopped "
                      "turning with requests generating (its stub killed, the server restarted)",
                      "# TYPE specdec_orchestrator_hangs_total counter",
                      f"specdec_orchestrator_hangs_total {self.orchestrator_hangs}"]
            lines += ["# HELP specdec_model_execute_hangs_total Times a text model (preprocessing, postprocessing) "
                      "hung: an instance in one execute, or requests pending and none executed, past the hang "
                      "timeout (its stubs killed, the model reloaded)", "# TYPE specdec_model_execute_hangs_total counter"]
            lines += [f'specdec_model_execute_hangs_total{{model="{m}"}} {n}' for m, n in sorted(self.execute_hangs.items())]
        lines += ["# HELP specdec_stranded_shm_regions Shared-memory regions of stubs that died serving requests, "
                  "still held by tritonserver until it restarts (Triton's Python backend keeps their instances)",
                  "# TYPE specdec_stranded_shm_regions gauge", f"specdec_stranded_shm_regions {len(stranded)}",
                  "# HELP specdec_stranded_shm_bytes The memory those regions hold",
                  "# TYPE specdec_stranded_shm_bytes gauge", f"specdec_stranded_shm_bytes {sum(stranded.values())}"]
        return "\n".join(lines) + "\n"
