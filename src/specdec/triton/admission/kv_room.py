"""Waiting for room in target_model's KV cache: by priority, then first come first served, across every
orchestrator instance.

A new request reserves its whole generation in target_model's KV pool with its first call; when the
pool is full that call is refused (`NoCapacity`) and the request waits (`when_full: queue`) or is
refused UNAVAILABLE (`reject`). Waiting requests form one line per server, whatever instance they run
in, so that a long request is not passed again and again by short ones that fit the room it waits for:

- The line is a `TicketLine` (ticket_line.py): a ticket per waiting request, ordered by priority and then
  arrival, in a directory private to the server; a process that dies leaves no place behind.
- Only the first in line asks target_model again; a new request joins the line whenever there is one
  instead of asking first. Within an instance only its first waiter reads the line (one directory
  listing per `poll_s`), however long it is.
- The first in line asks again after ROOM_RETRY_S (10 ms doubling to 100 ms) or as soon as any request
  of the server has released its caches: a request that ends while others wait appends a byte to a
  file the first in line watches (`poll_s`), and wakes its own instance's first in line at once.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Awaitable, Callable

from specdec.triton.admission import ticket_line as lines
from specdec.triton.admission.cancellation import scratch_base
from specdec.triton.admission.counts import RequestCounts
from specdec.triton.admission.ticket_line import Ticket, TicketLine

# The first in line asks target_model again after this wait, doubling up to the second value, or as soon
# as a request has released its caches: a retry is one BLS call that fails before any forward.
ROOM_RETRY_S = (0.01, 0.1)


PREFIX = "specdec-room-"  # then the server's PID


def default_directory(server_pid: int | None = None) -> Path:
    return scratch_base() / f"{PREFIX}{server_pid or os.getppid()}"


class RoomLine(TicketLine):
    """The server's line for KV room, as one orchestrator instance sees it (see the module's docstring)."""

    def __init__(self, directory: Path | None = None, poll_s: float = 0.005):
        base = directory or default_directory()
        super().__init__(base / "line")
        # A byte is appended when a request ends while others wait: its size changes with every release
        # (appends are atomic), and it is emptied when the line is.
        self._released = os.open(base / "released", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.poll_s = poll_s
        self._freed: asyncio.Future | None = None  # wakes this instance's first in line

    def leave(self, ticket: Ticket) -> None:
        super().leave(ticket)
        if not self.waiting():  # racing a release only makes a waiter ask once more
            os.ftruncate(self._released, 0)

    # ---- caches released --------------------------------------------------------------------------
    def freed(self) -> None:
        """A request of this instance has released its caches: the first in line may find room now."""
        if self._freed is not None and not self._freed.done():
            self._freed.set_result(None)
        if self.waiting():
            os.write(self._released, b"\0")

    def released(self) -> int:
        """A count that changes whenever a request of the server releases its caches while others wait."""
        return os.fstat(self._released).st_size

    async def until_freed(self, timeout_s: float, seen: int) -> None:
        """Sleep `timeout_s`, or less if a request releases its caches meanwhile (at once if one has since
        `released()` read `seen`)."""
        if self._freed is None or self._freed.done():
            self._freed = asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + timeout_s
        while self.released() == seen and not self._freed.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.wait({self._freed}, timeout=min(left, self.poll_s))


class RoomWait:
    """A new request's wait for room in target_model's KV cache (`generate`'s wait_for_room).

    `line_up` before its first call puts it behind the server's line if there is one; called after a
    refusal it joins the line and waits until it is first, then for ROOM_RETRY_S or a release, and says
    to ask again. While it waits a request counts among the queued requests, not the live ones (nor for
    the verify gate, which would otherwise hold the others' verifies for it). It gives up at once with
    when_full=reject, or when the request is cancelled (then `cancelled` is set).
    """

    def __init__(self, line: RoomLine, counts: RequestCounts, is_cancelled: Callable[[], Awaitable[bool]],
                 reject: bool = False, priority: int = 0):
        """is_cancelled: asks the request's cancellation sources; reject: when_full=reject (no waiting);
        priority: its place in line (lower first)."""
        self.line, self.counts, self.is_cancelled, self.reject = line, counts, is_cancelled, reject
        self.priority = priority
        self.waits, self.queued, self.cancelled = 0, False, False
        self.waited_s, self._since = 0.0, 0.0  # time spent queued, for the queue-time histogram
        self.ticket: Ticket | None = None
        self.seen = self.line.released()  # the last release before its last call to target_model

    async def line_up(self) -> bool:
        """Before a new request's first call: behind the server's line if there is one. False: cancelled
        while it waited."""
        if not self.line.waiting():
            return True
        self._queue()
        return await self._first_in_line()

    async def __call__(self) -> bool:
        """Wait until this request should ask again (True), or give up (False)."""
        if self.reject or await self._is_cancelled():
            return False
        self._queue()
        if not await self._first_in_line():
            return False
        await self.line.until_freed(min(ROOM_RETRY_S[0] * 2 ** self.waits, ROOM_RETRY_S[1]), self.seen)
        self.seen = self.line.released()
        self.waits += 1
        return True

    def _queue(self) -> None:
        """Counted as queued, not live, and in line (once)."""
        if not self.queued:
            self.queued, self._since = True, time.monotonic()
            self.counts.queue()
        if self.ticket is None:
            self.ticket = self.line.join(self.priority)

    async def _first_in_line(self) -> bool:
        """Wait until its ticket is first among its instance's, then until it is first in the server's line,
        asking for a cancellation every CANCEL_CHECK_S (ticket_line.py); False if cancelled."""
        name = self.ticket.name
        first = await lines.wait_in_line(
            self.line, self.ticket, lambda: self.line.first() == name or None, self.line.poll_s, self._is_cancelled
        )
        return first is not None

    async def _is_cancelled(self) -> bool:
        self.cancelled = await self.is_cancelled()
        return self.cancelled

    def admitted(self) -> None:
        """The request has its room (or is over): out of the line, the next waiter's turn; live again."""
        if self.ticket is not None:
            self.line.leave(self.ticket)
            self.ticket = None
        if self.queued:
            self.queued = False
            self.waited_s += time.monotonic() - self._since
            self.counts.admit()
