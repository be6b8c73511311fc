"""One process at a time on this machine for a stretch of work: an advisory file lock (`fcntl.flock`),
which the kernel releases when its holder exits or dies, so a killed process never leaves it held.
Where there is none (no fcntl, a path that cannot be opened), there is no ordering."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def held(path: str | Path) -> Iterator[None]:
    """Wait for the lock at `path` (created if missing), hold it for the block, release it."""
    try:
        import fcntl
        lock = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
