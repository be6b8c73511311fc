"""tritonserver as the launcher runs it: its output passed through the launcher, and when it counts as crashed.

A server that dies while serving (the kernel's OOM killer, a segfault in a backend) is restarted by the
launcher like a model's dead stub (watchdog.py). One crash does not end the process: Triton's handler of
a fatal signal (SIGSEGV, SIGABRT ...) writes `Signal (N) received.` and a stack trace, then calls exit(),
which runs destructors while the server's other threads go on, and which can hang. Seen once, after a
stub was SIGKILLed in the middle of a message: an uncaught `boost::interprocess::lock_exception` in the
Python backend aborted the server, whose exit then never finished; it kept answering health checks (the
watchdog even reloaded the dead model through it) while the requests in flight waited for ever. So the
launcher reads the server's output, copying each line to its own, and a server that reported a fatal
signal counts as crashed once `FATAL_EXIT_GRACE_S` has passed without it exiting.

A start can stall too. Seen once in CI, after a SIGABRT: the restarted server loaded every model, printed
its table of models, and never opened its endpoints (the next lines of a good start are DCGM's attempt at
GPU metrics, then the endpoints, all within a tenth of a second). The output says when the models are
loaded; a server whose endpoints are not up `ENDPOINTS_STALL_S` after that counts as stalled, and the
launcher starts it again.

A stop can hang too: Triton 2.51's gRPC endpoint waits, without a bound, for every open stream to close
(Triton 25.02 bounds that wait), so one tritonclient that keeps `start_stream` open between requests held a
SIGTERMed server for ever after it had unloaded every model (its endpoint's `Server::Stop` waiting), and the
launcher with it. The output says when the last model has unloaded; a server that has not exited
`ENDPOINTS_STOP_S` after that, or within its exit timeout and that grace, is killed (`stopped`).

And the launcher can die without stopping anything (SIGKILL, the OOM killer): its tritonserver (a session of
its own) and OpenAI API were left running, holding the ports the next start needs. Each is started with
`die_with_launcher`: the kernel sends it SIGTERM when the launcher goes, and it stops as on any SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Callable

# Triton's handlers write this line for every signal they catch, SIGTERM's graceful stop included:
# only these numbers say it crashed.
FATAL_SIGNALS = frozenset({signal.SIGILL, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGSEGV})
SIGNAL_LINE = re.compile(rb"^Signal \((\d+)\) received\.")
FATAL_EXIT_GRACE_S = 5.0  # Triton's exit after a fatal signal took under a second where it did not hang
# The header of the table Triton prints once every model has loaded (or failed to).
MODELS_TABLE = re.compile(rb"^\| Model +\| Version +\| Status +\|")
# From that table to open endpoints took 3-50 ms here; DCGM's start on a GPU machine takes a few seconds.
ENDPOINTS_STALL_S = 20.0
# What a stopping Triton prints each second while its models unload, with the count still live; at 0, the last
# line before its endpoints stop, which took under a second here where no open stream held them.
LIVE_LINE = re.compile(rb".*Found (\d+) live models and \d+ in-flight non-inference requests")
ENDPOINTS_STOP_S = 5.0
EXIT_TIMEOUT_S = 30.0  # tritonserver's --exit-timeout-secs unless its command says otherwise
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h): the signal a process gets when its parent thread exits


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def die_with_launcher(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen `preexec_fn` that has the child sent `signum` when this process dies, or None where the kernel
    offers no such thing (not Linux). The kernel sends it when the *thread* that started the child exits: the
    launcher starts its processes from its main thread, which outlives them."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # libc's, as this process has it loaded
    parent = os.getpid()

    def bind() -> None:  # in the child, between fork and exec
        # Until the exec the child runs this process's Python handler, which would only queue the signal.
        with contextlib.suppress(ValueError):
            signal.signal(signum, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the prctl: the kernel will not tell
            os.kill(os.getpid(), signum)

    return bind


class ServerProcess:
    """tritonserver started in a process group of its own (its stubs join it), its stdout and stderr copied
    line by line to `out` by a thread of its own. `process` is the Popen, for waiting and stopping."""

    def __init__(self, command: list[str], env: dict[str, str], out: BinaryIO | None = None,
                 grace_s: float = FATAL_EXIT_GRACE_S, clock: Callable[[], float] = time.monotonic,
                 stall_s: float = ENDPOINTS_STALL_S):
        self.grace_s, self.clock, self.stall_s = grace_s, clock, stall_s
        self.out = out if out is not None else sys.stdout.buffer
        self.fatal: tuple[int, float] | None = None  # the fatal signal it reported, and when
        self.loaded_at: float | None = None  # when it printed its table of loaded models
        self.unloaded_at: float | None = None  # when a stop had unloaded every model it can
        # Model versions this server cannot unload, set before its stop: those whose stub died serving requests
        # (Triton 24.10 never releases them; the watchdog's `stranded_versions`). Its stop counts as done when
        # only these are left, instead of waiting out its exit timeout for them.
        self.stranded_models = 0
        self.left_stranded = 0  # how many of them its stop found left
        self.exit_timeout_s = exit_timeout(command)
        self.process = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_launcher(),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._relay = threading.Thread(target=self._copy_output, daemon=True, name="server-output")
        self._relay.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _copy_output(self) -> None:
        for line in iter(self.process.stdout.readline, b""):
            try:
                self.out.write(line)
                self.out.flush()
            except (OSError, ValueError):  # the launcher's own output is gone: keep reading, or the server blocks
                pass
            match = SIGNAL_LINE.match(line)
            if match and self.fatal is None and int(match[1]) in FATAL_SIGNALS:
                self.fatal = (int(match[1]), self.clock())
            if self.loaded_at is None and MODELS_TABLE.match(line):
                self.loaded_at = self.clock()
            live = LIVE_LINE.match(line)
            if self.unloaded_at is None and live and int(live[1]) <= self.stranded_models:
                self.left_stranded = int(live[1])
                self.unloaded_at = self.clock()
        self.process.stdout.close()

    def crash(self) -> str | None:
        """Why the server counts as crashed, in words that follow its name (it exited, or it reported a fatal
        signal `grace_s` ago and still runs), or None."""
        code = self.process.poll()
        if code is not None:
            return f"exited with code {code}" + (f" ({signal_name(-code)})" if code < 0 else "")
        if self.fatal is not None and self.clock() - self.fatal[1] >= self.grace_s:
            return (f"reported {signal_name(self.fatal[0])} and has not exited "
                    f"{self.grace_s:g} s later")
        return None

    def stalled(self) -> str | None:
        """Asked while its endpoints are not up: why its start counts as stalled, in words that follow its
        name, or None."""
        if self.loaded_at is not None and self.clock() - self.loaded_at >= self.stall_s:
            return f"loaded its models and has not opened its endpoints {self.stall_s:g} s later"
        return None

    def stopped(self, log: Callable[[str], None], grace_s: float = ENDPOINTS_STOP_S, poll_s: float = 0.1) -> int:
        """Wait for a server asked to stop (SIGTERM) to exit, and return its exit code; kill it where it has not
        exited `grace_s` after it unloaded its last model (0 then: only its endpoints were left, held open by
        a client), at once where only its `stranded_models` were left (0 too: nothing else would happen until
        its exit timeout), or its exit timeout and `grace_s` after this call (its code then: -9)."""
        deadline = self.clock() + self.exit_timeout_s + grace_s
        while (code := self.process.poll()) is None:
            unloaded = self.unloaded_at is not None and (
                self.left_stranded > 0 or self.clock() - self.unloaded_at >= grace_s)
            if unloaded or self.clock() >= deadline:
                if unloaded and self.left_stranded:
                    why = (f"unloaded every model but the {self.left_stranded} held by stubs that died serving "
                           "requests (Triton never releases those)")
                elif unloaded:
                    why = (f"unloaded its models and did not exit {grace_s:g} s later (an open gRPC stream holds "
                           "its endpoint)")
                else:
                    why = f"did not stop within its exit timeout and {grace_s:g} s"
                log(f"tritonserver {why}: killed")
                self.process.kill()
                code = self.process.wait()
                return 0 if unloaded else code
            time.sleep(poll_s)
        return code

    def flushed(self, timeout_s: float = 5.0) -> None:
        """Wait until the output of an exited server has been copied (its last lines say why it stopped)."""
        self._relay.join(timeout_s)


def exit_timeout(command: list[str]) -> float:
    """The --exit-timeout-secs a tritonserver command gives (`=N` or `N` after it), else Triton's default."""
    for index, arg in enumerate(command):
        if arg.startswith("--exit-timeout-secs="):
            value = arg.split("=", 1)[1]
        elif arg == "--exit-timeout-secs" and index + 1 < len(command):
            value = command[index + 1]
        else:
            continue
        try:
            return float(value)
        except ValueError:  # tritonserver refuses it itself
            return EXIT_TIMEOUT_S
    return EXIT_TIMEOUT_S
