"""When a text model's current execute began, where the launcher's watchdog reads it.

preprocessing and postprocessing are steps of the ensemble that no orchestrator calls, so the orchestrator's
call timeout (`model_call_timeout_s`) never sees them hang; and a hung one holds every request behind it
while the server stays ready. Each of their instances keeps one file of 8 bytes in a directory the server's
stubs share: the wall-clock time (`time.time()`) its current execute began, 0.0 while none runs, and the
process that wrote it (a reloaded instance's new stub reuses the file). The watchdog (serving/watchdog.py)
kills the stub of an instance that has been executing for `--hang-timeout`, and reloads the model like any
whose stub died. (A stub that blocks before its execute begins stamps nothing: the watchdog sees that one
in Triton's own counters, requests pending while the model executes none.) A stamp is one `pwrite` (no message to the server, as a
Prometheus metric would be): about a microsecond per execute.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

from specdec.triton.admission.cancellation import scratch_base

STAMP = struct.Struct("<dq")  # since (wall-clock seconds; 0.0: idle), the writer's pid


PREFIX = "specdec-executing-"  # then the server's PID


def default_directory(server_pid: int | None = None) -> Path:
    return scratch_base() / f"{PREFIX}{server_pid or os.getppid()}"


class ExecuteClock:
    """`with clock:` around an execute: the instance's file says since when it runs, then 0.0 again."""

    def __init__(self, instance: str, directory: Path | None = None, clock=time.time):
        directory = directory or default_directory()
        directory.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._fd = os.open(directory / instance, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._pid = os.getpid()
        os.pwrite(self._fd, STAMP.pack(0.0, self._pid), 0)

    def __enter__(self) -> "ExecuteClock":
        os.pwrite(self._fd, STAMP.pack(self.clock(), self._pid), 0)
        return self

    def __exit__(self, *exc) -> None:
        os.pwrite(self._fd, STAMP.pack(0.0, self._pid), 0)

    def close(self) -> None:
        os.close(self._fd)


def stamps(directory: Path) -> dict[str, tuple[float, int]]:
    """Per instance that stamps its executes: since when its current one runs (0.0: none) and the pid of its
    stub (unreadable files: absent)."""
    found = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        try:
            data = (directory / name).read_bytes()
            if len(data) >= STAMP.size:
                found[name] = STAMP.unpack(data[:STAMP.size])
        except (OSError, struct.error):
            continue
    return found
