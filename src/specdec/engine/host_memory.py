"""Giving freed host memory back to the operating system (glibc's `malloc_trim`, or TCMalloc's release).

A CPU model stub allocates and frees buffers of many sizes per sequence (KV tensors that grow by
concatenation, activations of prompts of every length). glibc keeps freed blocks in its heaps for reuse,
and a heap whose top is still in use never shrinks on its own: the process's resident memory creeps up
under a long mixed load although nothing is live. `malloc_trim(0)` returns the
free pages of every heap (`madvise(MADV_DONTNEED)` inside heaps, not only at their top). Where the launcher
preloaded TCMalloc (serving/allocator.py), glibc's heaps hold nothing: TCMalloc's `ReleaseFreeMemory` gives
back the free spans it keeps instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
from typing import Callable


@functools.cache
def _tcmalloc_release():
    """TCMalloc's MallocExtension_ReleaseFreeMemory when TCMalloc is this process's allocator (preloaded),
    else None."""
    try:
        return ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory
    except (OSError, AttributeError):
        return None


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the free pages of the C heaps to the OS; False where the allocator cannot (neither glibc nor
    TCMalloc).

    Its cost grows with what there is to give back (hundreds of milliseconds after a heavy churn):
    callers keep it off the hot path.
    """
    release = _tcmalloc_release()
    if release is not None:
        release()
        return True
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class TrimSchedule:
    """When a stub hands its freed heap back: at most once per `interval_s` (0: never), and only once memory
    was freed since the last time (`freed`), so that an idle stub does not trim for nothing. `freed` may come
    from any thread; `due` from the one thread that trims."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self._freed = threading.Event()
        self._last = clock()

    def freed(self) -> None:
        self._freed.set()

    def due(self) -> bool:
        """Whether to trim now; True starts the next interval."""
        now = self.clock()
        if not self.interval_s or not self._freed.is_set() or now - self._last < self.interval_s:
            return False
        self._freed.clear()
        self._last = now
        return True
