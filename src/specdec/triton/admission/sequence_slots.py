"""The live-sequence cap (`max_live_sequences`) held across every orchestrator instance of one tritonserver.

Each `speculative_decoding` instance is its own stub process, so an asyncio semaphore would cap each
instance separately. A slot is instead an exclusive `flock` on one of `total` files in a directory
private to the server (named after the tritonserver process, like the cancellation board): taking one
is a few system calls per request, a process that dies frees its slots with its file descriptors, and a
slot taken in one instance is taken for all of them.

Slots are taken lowest index first, so when slot i is taken slots 0..i-1 are held: the highest index
taken plus one is how many requests generated at once at the busiest moment (`highest`).

Over the cap, requests wait in one line for the whole server, by priority and then first come first served
(ticket_line.py): only the first in line polls for a free slot, and a new request takes one at once only while
nobody waits.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Awaitable, Callable

from specdec.triton.admission import ticket_line as lines
from specdec.triton.admission.cancellation import scratch_base
from specdec.triton.admission.ticket_line import TicketLine


PREFIX = "specdec-slots-"  # then the server's PID, then the cap


def default_directory(total: int, server_pid: int | None = None) -> Path:
    # The cap in the name: instances that disagree on it cannot share slots by accident.
    return scratch_base() / f"{PREFIX}{server_pid or os.getppid()}-{total}"


def server_directories(server_pid: int) -> list[Path]:
    """Every slot directory of a server's stubs (one per cap they were loaded with)."""
    return sorted(scratch_base().glob(f"{PREFIX}{server_pid}-*"))


class SlotPool:
    def __init__(self, total: int, directory: Path | None = None, poll_s: float = 0.005):
        if total < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {total}")
        self.total = total
        self.directory = directory or default_directory(total)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._prefix = f"{self.directory}{os.sep}"
        self.poll_s = poll_s
        self.highest = 0  # the most slots this process has seen taken at once (the index it took + 1)
        self.line = TicketLine(self.directory / "line")  # the server's waiters, by priority then arrival

    def try_acquire(self) -> int | None:
        """Take the lowest free slot: its file descriptor (hand it to `release`), or None when all are taken."""
        for index in range(self.total):
            fd = os.open(f"{self._prefix}{index}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise
            self.highest = max(self.highest, index + 1)
            return fd
        return None

    def take_now(self) -> int | None:
        """A free slot unless requests already wait for one (they go first), else None."""
        return None if self.line.waiting() else self.try_acquire()

    async def acquire(self, cancelled: Callable[[], Awaitable[bool]] | None = None, priority: int = 0) -> int | None:
        """Wait for a slot, by priority (lower first) and then first come first served across the server's
        processes: only the first in line polls for one (every `poll_s`, only while the server is full).
        `cancelled` is asked every CANCEL_CHECK_S (ticket_line.py) meanwhile: once it says True the request
        leaves the line (None)."""
        ticket = self.line.join(priority)
        try:
            return await lines.wait_in_line(
                self.line, ticket, lambda: self.try_acquire() if self.line.first() == ticket.name else None,
                self.poll_s, cancelled)
        finally:
            self.line.leave(ticket)

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing the only descriptor of the open file drops its lock
