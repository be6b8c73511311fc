"""A file through which one process tells every model instance something (a client's reset of the caches,
cache_reset.py; the start and stop of a profile, live_profile.py): Triton has no way to address an instance,
but each can look at a path. The writer renames a new file into place (`replace`); each instance compares
what it finds with what it last saw (`Watch.due`, one stat) and so sees each new file once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class Watch:
    """One process's view of the file at `path` ("": never due)."""

    def __init__(self, path: str):
        self.path = path
        self.seen = self._state()  # a file from before this process started asks nothing of it

    def _state(self) -> tuple[int, int] | None:
        if not self.path:
            return None
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        # A new file each time: another inode, and a time set to the nanosecond (`replace`), where the
        # file system's own clock may tick only every few milliseconds
        return found.st_ino, found.st_mtime_ns

    def due(self) -> bool:
        """Whether a new file came since the last call (or since this process started)."""
        state = self._state()
        if state == self.seen:
            return False
        self.seen = state
        return state is not None  # a file removed asks for nothing


def replace(path: str, text: str) -> None:
    """A new file at `path` holding `text`, renamed into place whole (OSError if it cannot be written)."""
    target = Path(path)
    scratch = target.with_name(f".{target.name}.{os.getpid()}")
    scratch.write_text(text)
    now = time.time_ns()
    os.utime(scratch, ns=(now, now))
    os.replace(scratch, target)
