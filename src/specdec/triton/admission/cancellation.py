"""Cancellation flags shared by the processes of one tritonserver.

Triton's ensemble scheduler propagates a client's cancellation only to the *next* step it schedules,
not to a step already running: the long-running `speculative_decoding` request never sees it, while
every `postprocessing` request scheduled after it arrives cancelled. So postprocessing raises the
flag for the sequence it decodes and the orchestrator checks it every round.

Flags are marker files in a directory private to the server (named after the tritonserver process,
the parent of every stub), in /dev/shm when it exists: one stat per round, no configuration, and it
works whatever the number of orchestrator instances.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def scratch_base() -> Path:
    """Where the directories the stubs of one server share go (this board, the live-sequence slots), each
    named specdec-<what>-<the server's PID>[-<more>] (the launcher removes them: launcher.scratch_directories)."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


PREFIX = "specdec-cancel-"  # then the server's PID


def default_directory(server_pid: int | None = None) -> Path:
    return scratch_base() / f"{PREFIX}{server_pid or os.getppid()}"


class CancellationBoard:
    def __init__(self, directory: Path | None = None):
        self.directory = directory or default_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._prefix = f"{self.directory}{os.sep}"

    def _path(self, key: int) -> Path:
        return self.directory / f"{key:x}"

    def cancel(self, key: int) -> None:
        self._path(key).touch()

    def is_cancelled(self, key: int) -> bool:
        # Twice a round: a plain string and os.stat, not a Path object.
        return os.path.exists(f"{self._prefix}{key:x}")

    def clear(self, key: int) -> None:
        self._path(key).unlink(missing_ok=True)

    def sweep(self, older_than_s: float = 600.0) -> None:
        """Remove flags raised after their generation had already finished."""
        deadline = time.time() - older_than_s
        for path in self.directory.iterdir():
            try:
                if path.stat().st_mtime < deadline:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
