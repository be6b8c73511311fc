"""Waiting for room in target_model's KV cache (`kv_room.py`: `RoomLine`, one per orchestrator instance over a
directory the server's instances share, and `RoomWait`, the loop's wait_for_room): counted as queued once
while it waits and not as live (nor at the verify gate); one line for every instance, first come first
served, in which only the first asks and a new request lines up behind the waiters; the first in line
asking again as soon as a request of any instance releases its caches; a dead process's place skipped;
refused at once with when_full=reject, and ended by a cancellation from either source (the board for an
ensemble's, the response sender for a direct caller's), also while waiting for its turn."""

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest

from specdec.triton.admission import ticket_line as line_module
from specdec.triton.admission import kv_room as room_module
from specdec.triton.orchestrator import SpeculativeDecodingAdapter
from specdec.triton.admission.counts import RequestCounts
from specdec.triton.admission.kv_room import RoomLine, RoomWait


class Board:
    def __init__(self):
        self.cancelled = set()

    def is_cancelled(self, seq_id):
        return seq_id in self.cancelled


class Gate:
    def __init__(self):
        self.live = 1  # the waiting request itself

    def enter(self):
        self.live += 1

    def leave(self):
        self.live -= 1


class Metrics:
    def __init__(self):
        self.live = []

    def set_live(self, live, peak):
        self.live.append(live)


class Adapter:
    """An orchestrator instance as far as RoomWait goes; instances made over one directory share the line."""

    def __init__(self, directory, when_full="queue"):
        self.when_full, self.cancellations = when_full, Board()
        self.ipc = concurrent.futures.ThreadPoolExecutor(1)
        self.gate, self.metrics = Gate(), Metrics()
        self.counts = RequestCounts(self.gate, lambda live, queued: self.metrics.set_live(live, 1))
        self.room = RoomLine(directory, poll_s=0.001)

    is_cancelled = SpeculativeDecodingAdapter.is_cancelled  # the board, then the sender

    @property
    def queued(self):
        return self.counts.queued

    def wait(self, seq_id, sender):
        """A request's RoomWait, as the orchestrator makes it."""
        return RoomWait(self.room, self.counts, lambda: self.is_cancelled(seq_id, sender),
                        reject=self.when_full == "reject")


class Sender:
    def __init__(self):
        self.cancelled = False

    def is_cancelled(self):
        return self.cancelled


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(room_module, "ROOM_RETRY_S", (0.001, 0.002))
    monkeypatch.setattr(line_module, "CANCEL_CHECK_S", 0.01)


@pytest.fixture
def line_dir(tmp_path):
    return tmp_path / "room"


def empty(adapter):
    return adapter.queued == 0 and not adapter.room.holds() and not adapter.room.waiting()


def test_waits_counted_once_then_admitted(line_dir):
    adapter = Adapter(line_dir)
    room = adapter.wait(3, Sender())

    async def main():
        assert await room() and await room() and await room()
        assert adapter.queued == 1 and room.waits == 3 and adapter.room.waiting()
        await asyncio.sleep(0.02)
        assert adapter.gate.live == 0 and adapter.metrics.live == [0]  # waiting is not generating
        room.admitted()
        room.admitted()  # idempotent: every round and the request's end call it

    asyncio.run(main())
    assert empty(adapter) and adapter.gate.live == 1 and adapter.metrics.live == [0, 1]
    assert 0.02 < room.waited_s < 5  # what the queue-time histogram gets


def test_reject_never_waits(line_dir):
    adapter = Adapter(line_dir, "reject")
    room = adapter.wait(3, Sender())
    assert not asyncio.run(room()) and adapter.queued == 0 and not room.cancelled and not adapter.room.waiting()


@pytest.mark.parametrize("where", ["board", "sender"])
def test_a_cancellation_ends_the_wait(line_dir, where):
    adapter, sender = Adapter(line_dir), Sender()
    room = adapter.wait(3, sender)

    async def main():
        assert await room()
        if where == "board":
            adapter.cancellations.cancelled.add(3)
        else:
            sender.cancelled = True
        assert not await room()
        room.admitted()

    asyncio.run(main())
    assert room.cancelled and empty(adapter) and adapter.gate.live == 1


def test_one_line_across_instances_in_arrival_order(line_dir):
    """Waiters of two instances (one directory) ask one at a time, in the order they joined."""
    first, second = Adapter(line_dir), Adapter(line_dir)
    rooms = [adapter.wait(seq_id, Sender()) for seq_id, adapter in ((1, first), (2, second), (3, first))]
    asked = []

    async def waiter(seq_id, room, times):
        for _ in range(times):  # the loop's retries: each True is one more call to target_model
            assert await room()
            asked.append(seq_id)
        room.admitted()

    async def main():
        tasks = []
        for seq_id, room in enumerate(rooms, 1):  # joined in this order
            tasks.append(asyncio.ensure_future(waiter(seq_id, room, 3)))
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert asked == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # never two waiters asking in the same stretch
    assert empty(first) and empty(second)


def test_a_lower_priority_value_asks_first_whenever_it_joined(line_dir):
    """Behind a first in line of priority -5 (asking, not yet admitted), requests of priorities 0, 0 and -1
    join in that order across two instances: once the first has its room the -1 asks first, then the two 0s
    in arrival order; the latecomer passes its own instance's earlier waiter too."""
    first, second = Adapter(line_dir), Adapter(line_dir)
    head = RoomWait(first.room, first.counts, lambda: asyncio.sleep(0, False), priority=-5)
    rooms = {seq_id: RoomWait(adapter.room, adapter.counts, lambda: asyncio.sleep(0, False), priority=priority)
             for seq_id, adapter, priority in ((1, first, 0), (2, second, 0), (3, first, -1))}
    asked = []

    async def waiter(seq_id, room, times):
        for _ in range(times):
            assert await room()
            asked.append(seq_id)
        room.admitted()

    async def main():
        assert await head()  # first in line, asking target_model
        tasks = []
        for seq_id, room in rooms.items():
            tasks.append(asyncio.ensure_future(waiter(seq_id, room, 2)))
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        assert asked == []  # the head still holds the line
        head.admitted()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert asked == [3, 3, 1, 1, 2, 2]
    assert empty(first) and empty(second)


def test_a_new_request_lines_up_behind_the_waiters_of_any_instance(line_dir):
    here, there = Adapter(line_dir), Adapter(line_dir)
    first, newcomer = here.wait(1, Sender()), there.wait(2, Sender())

    async def main():
        assert await newcomer.line_up() and not newcomer.queued  # no line: its first call goes at once
        newcomer.admitted()
        assert newcomer.waited_s == 0
        assert await first()  # no room for the first: it is first in line
        late = there.wait(3, Sender())
        lining = asyncio.ensure_future(late.line_up())
        await asyncio.sleep(0.05)
        assert not lining.done() and late.queued and there.queued == 1  # behind the first, queued
        first.admitted()  # the first got its room
        assert await lining  # now it is the late one's turn to ask
        late.admitted()
        assert late.waited_s >= 0.05

    asyncio.run(main())
    assert empty(here) and empty(there)


def test_a_waiter_cancelled_before_its_turn_leaves_the_line(line_dir):
    adapter = Adapter(line_dir)
    first, second = adapter.wait(1, Sender()), adapter.wait(2, Sender())

    async def main():
        assert await first()  # holds the turn
        waiting = asyncio.ensure_future(second())
        await asyncio.sleep(0.03)
        assert not waiting.done()
        adapter.cancellations.cancelled.add(2)
        assert not await waiting and second.cancelled
        second.admitted()  # the request's end
        first.admitted()
        third = adapter.wait(3, Sender())
        assert await third()  # the line moves on: nobody holds a stale turn or place
        third.admitted()

    asyncio.run(main())
    assert empty(adapter)


def test_a_request_cancelled_in_line_never_asks(line_dir):
    here, there = Adapter(line_dir), Adapter(line_dir)
    first, late = here.wait(1, Sender()), there.wait(2, Sender())

    async def main():
        assert await first()
        lining = asyncio.ensure_future(late.line_up())
        await asyncio.sleep(0.02)
        there.cancellations.cancelled.add(2)
        assert not await lining and late.cancelled
        late.admitted()
        first.admitted()

    asyncio.run(main())
    assert empty(here) and empty(there)


@pytest.mark.parametrize("where", ["same instance", "other instance"])
def test_a_release_wakes_the_first_in_line_before_its_back_off(line_dir, monkeypatch, where):
    monkeypatch.setattr(room_module, "ROOM_RETRY_S", (5.0, 5.0))
    here = Adapter(line_dir)
    releasing = here if where == "same instance" else Adapter(line_dir)
    room = here.wait(1, Sender())

    async def main():
        asyncio.get_running_loop().call_later(0.05, releasing.room.freed)  # another request ends
        started = time.monotonic()
        assert await room()
        woke = time.monotonic() - started
        # Released while it was asking (between two waits): it asks again without sleeping.
        releasing.room.freed()
        started = time.monotonic()
        assert await room()
        again = time.monotonic() - started
        room.admitted()
        return woke, again

    woke, again = asyncio.run(main())
    assert 0.04 < woke < 1.0 and again < 0.5
    assert empty(here)


def test_the_place_of_a_process_that_died_is_skipped(line_dir):
    """A process killed while in line (its ticket's lock dropped with it) does not hold the line up."""
    line_dir.mkdir(parents=True)
    code = ("import sys, time; from pathlib import Path; from specdec.triton.admission.kv_room import RoomLine; "
            "RoomLine(Path(sys.argv[1])).join(); print('in line', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, str(line_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "in line"
        adapter = Adapter(line_dir)
        room = adapter.wait(1, Sender())

        async def blocked():
            assert await room.line_up() is False  # behind the live process: cancelled while waiting

        adapter.cancellations.cancelled.add(1)
        asyncio.run(blocked())
        room.admitted()
        assert adapter.room.waiting()  # the live process's place stays
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    adapter = Adapter(line_dir)
    room = adapter.wait(2, Sender())

    async def main():
        # First in line: the dead process's ticket is skipped and removed (else this would wait for ever).
        assert await asyncio.wait_for(room(), 5)
        room.admitted()

    asyncio.run(main())
    assert empty(adapter) and os.listdir(line_dir / "line") == []
