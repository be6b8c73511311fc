"""The line shared by the stub processes of one server (every orchestrator instance): by priority, then first
come first served.

Used for the waits of admission: for a live-sequence slot (`sequence_slots.py`) and for room in target_model's KV
cache (`kv_room.py`). A place in line is a ticket: a file named by its request's priority and the monotonic
clock (system-wide on Linux) at the moment the request joined, in a directory private to the server, held
under an exclusive `flock` while the request waits. The line is the sorted names: a lower priority value
first (vLLM's order; 0 by default), then arrival. A ticket whose lock is free belongs to a process that died
(its descriptors closed, its locks dropped) and is removed by whoever finds it first.

Within a process only the waiter whose ticket is first among the process's own reads the server's line (one
directory listing per poll, however many wait); the others sleep until the process's tickets change.
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
# A request's priority: an INT32, lower first. Names hold it shifted to 0 .. 2**32 - 1, ten digits, so that
# sorting the names sorts priorities.
PRIORITY_OFFSET = 2**31


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
        self._moved: asyncio.Future | None = None  # done when this process's tickets change (`moved`)

    def waiting(self) -> bool:
        """Whether anybody is in line (one directory listing)."""
        return bool(os.listdir(self.directory))

    def join(self, priority: int = 0) -> Ticket:
        """A place in line for a request of this priority (an INT32: lower goes first)."""
        name = f"{priority + PRIORITY_OFFSET:010d}-{time.monotonic_ns():020d}-{os.getpid()}-{next(self._numbers)}"
        # Locked before it is in line (renamed into it), so no reader ever takes it for abandoned.
        unlisted = f"{self.directory.parent}{os.sep}.{self.directory.name}-{name}"
        fd = os.open(unlisted, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(unlisted, f"{self._prefix}{name}")
        self._mine.add(name)
        self._wake()
        return Ticket(name, fd)

    def leave(self, ticket: Ticket) -> None:
        self._mine.discard(ticket.name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self._prefix}{ticket.name}")
        os.close(ticket.fd)
        self._wake()

    def holds(self) -> bool:
        """Whether a request of this process is in line."""
        return bool(self._mine)

    def first_here(self, name: str) -> bool:
        """Whether no other ticket of this process is ahead of this one (its turn to read the line)."""
        return name == min(self._mine)

    async def moved(self, timeout_s: float) -> None:
        """Sleep until this process's tickets change (one joins or leaves), at most `timeout_s`."""
        loop = asyncio.get_running_loop()
        if self._moved is None or self._moved.get_loop() is not loop:
            self._moved = loop.create_future()
        await asyncio.wait({self._moved}, timeout=timeout_s)

    def _wake(self) -> None:
        if self._moved is not None:
            if not self._moved.done():
                self._moved.set_result(None)
            self._moved = None

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
    line: TicketLine,
    ticket: Ticket,
    attempt: Callable[[], T | None],
    poll_s: float,
    cancelled: Callable[[], Awaitable[bool]] | None = None,
) -> T | None:
    """A waiter's whole wait: until its ticket is first among its process's own (`first_here`: the process's
    earlier and higher-priority waiters read the line first), then `attempt()` every `poll_s` until it
    returns a result (for example a slot once the ticket is first in the server's line). `cancelled` is
    asked every CANCEL_CHECK_S meanwhile: once it says True the wait ends with None. The caller leaves the
    line."""
    asked = time.monotonic()
    while True:
        if line.first_here(ticket.name):
            if (result := attempt()) is not None:
                return result
            await asyncio.sleep(poll_s)
        else:
            await line.moved(CANCEL_CHECK_S)
        if cancelled is not None and time.monotonic() - asked >= CANCEL_CHECK_S:
            asked = time.monotonic()
            if await cancelled():
                return None
