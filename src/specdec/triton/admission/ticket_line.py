"""A first-come-first-served line shared by the stub processes of one server (every orchestrator instance).

Used for the waits of admission: for a live-sequence slot (`sequence_slots.py`) and for room in target_model's KV
cache (`kv_room.py`). A place in line is a ticket: a file named by the monotonic clock (system-wide on
Linux) at the moment its request joined, in a directory private to the server, held under an exclusive
`flock` while the request waits. The line is the sorted names. A ticket whose lock is free belongs to a
process that died (its descriptors closed, its locks dropped) and is removed by whoever finds it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import os
import time
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

# How often a request waiting in line asks whether it was cancelled (for a direct caller, an IPC round trip).
CANCEL_CHECK_S = 0.5


class Ticket:
    """A place in line: the file's name and the descriptor holding its lock."""

    def __init__(self, name: str, fd: int):
        self.name, self.fd = name, fd


class TicketLine:
    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._prefix = f"{directory}{os.sep}"
        self._numbers = itertools.count()
        self._mine: set[str] = set()  # this process's tickets (their locks are its own)

    def waiting(self) -> bool:
        """Whether anybody is in line (one directory listing)."""
        return bool(os.listdir(self.directory))

    def join(self) -> Ticket:
        name = f"{time.monotonic_ns():020d}-{os.getpid()}-{next(self._numbers)}"
        # Locked before it is in line (renamed into it), so no reader ever takes it for abandoned.
        unlisted = f"{self.directory.parent}{os.sep}.{self.directory.name}-{name}"
        fd = os.open(unlisted, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(unlisted, f"{self._prefix}{name}")
        self._mine.add(name)
        return Ticket(name, fd)

    def leave(self, ticket: Ticket) -> None:
        self._mine.discard(ticket.name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self._prefix}{ticket.name}")
        os.close(ticket.fd)

    def first(self) -> str | None:
        """The name of the ticket whose turn it is, removing those of processes that died on the way."""
        for name in sorted(os.listdir(self.directory)):
            if name in self._mine or not self._abandoned(name):
                return name
        return None

    def _abandoned(self, name: str) -> bool:
        try:
            fd = os.open(f"{self._prefix}{name}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True  # left the line meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # its request still waits
            raise
        finally:
            os.close(fd)  # drops the lock if it was taken
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self._prefix}{name}")
        return True


async def wait_in_line(
    turn: asyncio.Future,
    attempt: Callable[[], T | None],
    poll_s: float,
    cancelled: Callable[[], Awaitable[bool]] | None = None,
) -> T | None:
    """A waiter's whole wait: first for `turn` (an `asyncio.Lock.acquire()` in flight: the process's
    earlier waiters read the line first), then `attempt()` every `poll_s` until it returns a result (for
    example a slot once the waiter's ticket is first). `cancelled` is asked every CANCEL_CHECK_S meanwhile:
    once it says True the wait ends with None. The caller leaves the line and ends its turn (`end_turn`)."""
    while not turn.done():
        await asyncio.wait({turn}, timeout=CANCEL_CHECK_S)
        if not turn.done() and cancelled is not None and await cancelled():
            return None
    asked = time.monotonic()
    while (result := attempt()) is None:
        await asyncio.sleep(poll_s)
        if cancelled is not None and time.monotonic() - asked >= CANCEL_CHECK_S:
            asked = time.monotonic()
            if await cancelled():
                return None
    return result


def end_turn(lock: asyncio.Lock, turn: asyncio.Future) -> None:
    """Give the process's next waiter its turn, whether or not this one's had come."""
    if turn.done() and not turn.cancelled():
        lock.release()
    else:
        turn.cancel()  # asyncio.Lock passes a wake-up it had already given on to the next waiter
