"""Torch profiler traces of the models' executions, started and stopped by a client while the server serves
(vLLM's and SGLang's POST /start_profile and /stop_profile, which their benchmarks' `--profile` call): the CPU
operators, and on a GPU the kernels, of every execute of target_model and of each draft model, as Perfetto and
chrome://tracing read them.

The operator enables it: the launcher's --torch-profiler-dir (DIR_ENV; vLLM's and SGLang's variables too) names
the traces' directory and a control file (CONTROL_ENV, one per server) in the environment of every stub and of
the API. The API writes a command there (`send`: JSON, a new file each time, marker_file.py); each model
instance looks (one stat) as each execute begins and so sees each command once.

Torch's profiler records the CPU operators of the thread that started it only, and stopping it from another
thread crashes the process, while Triton calls execute on the stub's thread and nothing runs there between
calls. A profile so has a thread of its own (`Session`), begun at the first execute after the start: it runs
every execute until the profile ends (handed over and awaited, tens of microseconds each: a profiled server's
speed is not its speed anyway) and, idle, looks at the control file every POLL_S, so that a stop needs no
traffic to be seen. It writes DIR/<profile id>-<model>-<pid>.trace.json.gz, with a `.tracing` file beside it
until the trace is whole, which the API's stop waits for (`unfinished`) before it answers.
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import os
import queue
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdec.engine.threads import adopt_torch_threads
from specdec.triton import marker_file

DIR_ENV = "SPECDEC_TORCH_PROFILER_DIR"  # the traces' default directory; unset: no live profiling
PEER_DIR_ENVS = ("VLLM_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR")  # read by the launcher where DIR_ENV is not
CONTROL_ENV = "SPECDEC_PROFILE_CONTROL_FILE"  # the commands' file, set by the launcher with DIR_ENV
ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's names: CPU operators, GPU kernels (CUDA), memory allocations
DEFAULT_ACTIVITIES = ("CPU", "GPU")
POLL_S = 0.1  # how often an idle profile looks for a stop
TRACE_SUFFIX, UNFINISHED_SUFFIX = ".trace.json.gz", ".tracing"
HOST_KINDS = {"cpu_op": "torch's CPU operators", "python_function": "Python's functions"}  # a trace's categories


def control_file(http_port: int) -> Path:
    """The control file the launcher names for the server on http_port (one per server on a machine)."""
    return Path(tempfile.gettempdir()) / f"specdec-profile-{http_port}"


def directory_from_env(env) -> str:
    """The traces' directory an environment names (ours, else vLLM's, else SGLang's; "": none)."""
    for name in (DIR_ENV, *PEER_DIR_ENVS):
        if env.get(name, "").strip():
            return env[name].strip()
    return ""


@dataclass(frozen=True)
class Command:
    """What the API asks of every instance: a profile started (with its settings) or stopped."""

    action: str  # "start" or "stop"
    profile_id: str
    output_dir: str
    activities: tuple[str, ...] = DEFAULT_ACTIVITIES
    start_step: int = 0  # executions run unprofiled first (a warm-up's)
    num_steps: int | None = None  # executions profiled, then the profile ends by itself; None: until a stop
    with_stack: bool = True  # Python's frames with each operator (SGLang's and vLLM's default)
    record_shapes: bool = False

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def decode(text: str) -> "Command | None":
        """The command a control file holds (None if it holds none: a partial or foreign file)."""
        try:
            fields = json.loads(text)
            return Command(**{**fields, "activities": tuple(fields["activities"])})
        except (ValueError, TypeError, KeyError):
            return None

    def trace_name(self, model: str, pid: int) -> str:
        return f"{self.profile_id}-{model}-{pid}"


def new_profile_id(now: float | None = None) -> str:
    """A profile's id: its start's UTC time to the millisecond (sorts as the traces were taken)."""
    now = time.time() if now is None else now
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}"


class SettingError(ValueError):
    """A start's setting refused; `field` names it."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


def start_command(fields: dict, default_dir: str, profile_id: str) -> Command:
    """SGLang's /start_profile body (all optional: output_dir, activities, start_step, num_steps, with_stack,
    record_shapes; others it defines are accepted and change nothing here) as a start command. SettingError
    naming the field on a bad value."""
    if not isinstance(fields, dict):
        raise SettingError(None, "the body: a JSON object of the profile's settings (or none)")

    def flag(name: str, default: bool) -> bool:
        value = fields.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SettingError(name, f"'{name}': {value!r} is not a boolean")
        return value

    def count(name: str, low: int) -> int | None:
        value = fields.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SettingError(name, f"'{name}': {value!r} is not an integer of at least {low}")
        return value

    output_dir = fields.get("output_dir") or default_dir
    if not isinstance(output_dir, str) or not os.path.isabs(output_dir):
        raise SettingError("output_dir", f"'output_dir': {output_dir!r} is not an absolute path on the server")
    activities = fields.get("activities") or list(DEFAULT_ACTIVITIES)
    if not isinstance(activities, list) or not activities or any(a not in ACTIVITIES for a in activities):
        raise SettingError("activities", f"'activities': {activities!r}: a list of {', '.join(ACTIVITIES)}")
    return Command("start", profile_id, os.path.normpath(output_dir), tuple(dict.fromkeys(activities)),
                   count("start_step", 0) or 0, count("num_steps", 1), flag("with_stack", True),
                   flag("record_shapes", False))


def send(path: str, command: Command) -> None:
    """Give every model instance the command (OSError if the file cannot be written)."""
    marker_file.replace(path, command.encode())


def current(path: str) -> Command | None:
    """The last command sent (None: none, or the file unreadable)."""
    try:
        return Command.decode(Path(path).read_text())
    except OSError:
        return None


def unfinished(command: Command) -> list[str]:
    """The traces of the profile still being written (their `.tracing` files' names, without the dot)."""
    try:
        names = os.listdir(command.output_dir)
    except OSError:
        return []
    prefix = f".{command.profile_id}-"
    return sorted(name[1:-len(UNFINISHED_SUFFIX)] for name in names
                  if name.startswith(prefix) and name.endswith(UNFINISHED_SUFFIX))


def traces(command: Command) -> list[str]:
    """The profile's trace files written so far (paths)."""
    directory = Path(command.output_dir)
    return sorted(str(path) for path in directory.glob(f"{command.profile_id}-*{TRACE_SUFFIX}"))


class Tracer:
    """One model instance's side: `run` each execute through it. `log` takes a line for the server's log."""

    def __init__(self, model: str, control_path: str, log: Callable[[str], None]):
        self.model, self.log = model, log
        self.watch = marker_file.Watch(control_path)
        self._lock = threading.Lock()
        self.session: Session | None = None
        self._primed = False

    def run(self, fn: Callable, *args):
        """fn(*args): on the profile's thread while one runs, else here."""
        with self._lock:
            self._look()
            session = self.session
        return fn(*args) if session is None else session.call(fn, args)

    def look_idle(self, session: "Session") -> bool:
        """From an idle profile's thread: a command that came meanwhile taken; whether that profile ends."""
        with self._lock:
            self._look()
            return self.session is not session

    def _look(self) -> None:
        """Under the lock: a new command ends the running profile; a start begins the next one."""
        if not self.watch.due():
            return
        command = current(self.watch.path)
        if command is None:
            return
        previous, self.session = self.session, None
        if previous is not None:
            previous.ending.set()
        if command.action == "start":
            if not self._primed:
                prime()
                self._primed = True
            self.session = Session(self, command, previous)
            self.session.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """At unload: a running profile ends and its trace is written."""
        with self._lock:
            session, self.session = self.session, None
        if session is not None:
            session.ending.set()
            session.join(timeout_s)

    def ended(self, session: "Session") -> None:
        with self._lock:
            if self.session is session:
                self.session = None


class Session(threading.Thread):
    """One profile in one model instance: the thread that runs its executions under torch's profiler."""

    def __init__(self, tracer: Tracer, command: Command, previous: "Session | None"):
        super().__init__(name=f"{tracer.model}-profile", daemon=True)
        self.tracer, self.command, self.previous = tracer, command, previous
        self.base = Path(command.output_dir) / command.trace_name(tracer.model, os.getpid())
        self.unfinished = self.base.with_name(f".{self.base.name}{UNFINISHED_SUFFIX}")
        try:  # made now, so that a stop from now on waits for this trace
            self.unfinished.parent.mkdir(parents=True, exist_ok=True)
            self.unfinished.touch()
        except OSError as exc:
            tracer.log(f"{tracer.model}: no profile in {command.output_dir}: {exc}")
        self.ending = threading.Event()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._gate = threading.Lock()
        self._closed = False
        self.profiled = 0

    def call(self, fn: Callable, args: tuple):
        """fn(*args) run on this thread and awaited (here instead, once the profile has ended)."""
        item = (fn, args, threading.Event(), [])
        with self._gate:
            queued = not self._closed
            if queued:  # an ended profile's thread runs what was queued before it closed (`run`'s end)
                self._work.put(item)
        if not queued:
            return fn(*args)
        item[2].wait()
        value, error = item[3]
        if error is not None:
            raise error
        return value

    def run(self) -> None:
        adopt_torch_threads()  # the executions' forwards on as many threads as on the stub's
        if self.previous is not None:
            self.previous.join()  # one torch profiler at a time in a process
        profiler, command = None, self.command
        skip, label = command.start_step, f"{self.tracer.model} execute"
        item = None
        try:
            while not self.ending.is_set():
                try:
                    item = self._work.get(timeout=POLL_S)
                except queue.Empty:
                    if self.tracer.look_idle(self):
                        break
                    continue
                if skip:
                    skip -= 1
                    self._do(item)
                    continue
                if profiler is None:
                    profiler = self._profiler()
                    profiler.start()
                    self.tracer.log(f"{self.tracer.model}: profiling into {self.base}{TRACE_SUFFIX}")
                self._do(item, f"{label} {self.profiled}")
                self.profiled += 1
                if command.num_steps is not None and self.profiled >= command.num_steps:
                    break
        except Exception as exc:  # noqa: BLE001 - the profiler's failure: serving goes on unprofiled
            self.tracer.log(f"{self.tracer.model}: profiling failed: {exc!r}")
        finally:
            if item is not None and not item[2].is_set():
                self._do(item)  # taken when the profiler failed to start
            try:
                if profiler is not None:
                    profiler.stop()
            finally:
                with self._gate:
                    self._closed = True
                while True:  # what came meanwhile runs unprofiled
                    try:
                        self._do(self._work.get_nowait())
                    except queue.Empty:
                        break
                self.tracer.ended(self)
                self._write(profiler)

    @staticmethod
    def _do(item, label: str | None = None) -> None:
        import torch

        fn, args, done, outcome = item
        try:
            if label is None:
                outcome[:] = [fn(*args), None]
            else:
                with torch.profiler.record_function(label):
                    outcome[:] = [fn(*args), None]
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise
            outcome[:] = [None, exc]
        done.set()

    def _profiler(self):
        import torch
        from torch.profiler import ProfilerActivity

        wanted = self.command.activities
        activities = [ProfilerActivity.CPU] if "CPU" in wanted or "MEM" in wanted else []
        if "GPU" in wanted and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities or [ProfilerActivity.CPU],
                                      record_shapes=self.command.record_shapes,
                                      profile_memory="MEM" in wanted, with_stack=self.command.with_stack)

    def _write(self, profiler) -> None:
        path, scratch = f"{self.base}{TRACE_SUFFIX}", self.unfinished.with_suffix(".json")
        try:
            if profiler is not None and self.profiled:
                started = time.perf_counter()
                profiler.export_chrome_trace(str(scratch))
                text = repaired(scratch.read_bytes())
                # the fastest level: a trace is hundreds of MB of JSON, and the stop waits for it
                with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as out:
                    out.write(text)
                self.tracer.log(f"{self.tracer.model}: {self.profiled} executions profiled into {path} "
                                f"(written in {time.perf_counter() - started:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - a failed trace must not fail serving
            self.tracer.log(f"{self.tracer.model}: the profile {path} was not written: {exc}")
        finally:
            scratch.unlink(missing_ok=True)
            self.unfinished.unlink(missing_ok=True)


def prime() -> None:
    """Torch's profiler set up on this thread (the stub's, where execute runs; about a second, once): begun
    first on a profile's own thread, Kineto logs that its set-up ran on another thread than its registration."""
    import torch

    warm = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    warm.start()
    warm.stop()


def summary(path: str, top: int = 15) -> str:
    """A trace's executions and where their time went, as markdown: the profiled executions' count and mean
    time; by self time (an event's time less that of the events it encloses, per thread) torch's CPU
    operators and, with with_stack, Python's functions (a C function's call its own event); from a GPU, kernels
    by device time; each as a share of the executions' summed time."""
    with gzip.open(path, "rt", encoding="utf-8") as trace:
        found = [e for e in json.load(trace)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    executions = [e for e in found if e.get("cat") == "user_annotation" and " execute " in e.get("name", "")]
    spent_us = sum(e["dur"] for e in executions) or 1.0
    within: dict[object, list[tuple[float, float]]] = {}  # per thread, its executions' spans
    for execution in sorted(executions, key=lambda e: e["ts"]):
        within.setdefault(execution["tid"], []).append((execution["ts"], execution["ts"] + execution["dur"]))

    def inside(event: dict) -> bool:  # not the waits of other threads (the stub's, handing executions over)
        spans = within.get(event["tid"], [])
        at = bisect.bisect_right(spans, (event["ts"], float("inf"))) - 1
        return at >= 0 and event["ts"] + event["dur"] <= spans[at][1]

    nested = sorted((e for e in found if e.get("cat") in HOST_KINDS and inside(e)),
                    key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    own: dict[str, dict[str, list[float]]] = {kind: {} for kind in HOST_KINDS}
    stack: list[tuple[float, dict, list]] = []  # (end, event, its entry) of the events enclosing the next one
    for event in nested:
        while stack and (stack[-1][1]["tid"] != event["tid"] or stack[-1][0] <= event["ts"]):
            stack.pop()
        entry = own[event["cat"]].setdefault(_display(event["name"]), [0, 0.0])
        entry[0] += 1
        entry[1] += event["dur"]
        if stack:
            stack[-1][2][1] -= event["dur"]
        stack.append((event["ts"] + event["dur"], event, entry))
    shares = ", ".join(f"{HOST_KINDS[kind]} {sum(us for _, us in table.values()) / spent_us:.1%}"
                       for kind, table in own.items() if table)
    lines = [f"### {Path(path).name}", "",
             f"{len(executions)} executions, {spent_us / max(len(executions), 1) / 1000:.3f} ms each on average; "
             f"their time by self time: {shares or 'no host events'} (the rest: between events, waits)", ""]
    kernels = _totals(e for e in found if e.get("cat") == "kernel")
    for title, table in ((f"{HOST_KINDS['cpu_op']}, by self time", own["cpu_op"]),
                         (f"{HOST_KINDS['python_function']}, by self time", own["python_function"]),
                         ("GPU kernels, by device time", kernels)):
        if not table:
            continue
        lines += [f"{title}:", "", "| | calls | ms | share of the executions |", "|---|---|---|---|"]
        for name, (calls, us) in sorted(table.items(), key=lambda item: -item[1][1])[:top]:
            lines.append(f"| `{name[:80]}` | {calls} | {us / 1000:.2f} | {us / spent_us:.1%} |")
        lines.append("")
    return "\n".join(lines)


_C_CALL = re.compile(r"<built-in (?:method|function) (\w+)(?: of .*)?>")


def _display(name: str) -> str:
    """A Python tracer's name of a C function's call without the object it was called on (`reshape (C)`):
    one row per function, not per tensor."""
    call = _C_CALL.fullmatch(name)
    return f"{call.group(1)} (C)" if call else name


def _totals(events) -> dict[str, list[float]]:
    table: dict[str, list[float]] = {}
    for event in events:
        entry = table.setdefault(event["name"], [0, 0.0])
        entry[0] += 1
        entry[1] += event["dur"]
    return table


# A field of Kineto's JSON, one per line (`  "name": "<text>",`), and where one may hold an unescaped quote:
# a value's quote followed by something other than its end (a cheap scan: a trace is hundreds of MB)
_FIELD = re.compile(r'^(\s*"[^"\\]+": ")(.*)("(,?))$', re.M)
_SUSPECT = re.compile(r'": "[^"\n]*"[^,\n]')


def repaired(raw: bytes) -> str:
    """A Chrome trace as Kineto wrote it, made valid JSON: torch's Python tracer (with_stack) at times names
    a frame with bytes that are no UTF-8 or with quotes, which Kineto writes unescaped (and Perfetto and
    json refuse); such bytes are replaced, such a field's text escaped."""
    text = raw.decode("utf-8", errors="replace")
    pieces, at = [], 0
    for suspect in _SUSPECT.finditer(text):
        start = text.rfind("\n", 0, suspect.start()) + 1
        end = text.find("\n", suspect.end())
        end = len(text) if end < 0 else end
        field = _FIELD.match(text, start, end)
        if field is None or start < at:
            continue
        try:
            json.loads("{" + field.group(0).rstrip().rstrip(",") + "}")
        except ValueError:
            pieces += [text[at:start], field.group(1)[:-1], json.dumps(field.group(2)), field.group(4)]
            at = end
    return "".join(pieces) + text[at:] if pieces else text

if __name__ == "__main__":  # python -m specdec.triton.live_profile TRACE...: each trace's summary
    import sys

    print("\n".join(summary(path) for path in sys.argv[1:]))
