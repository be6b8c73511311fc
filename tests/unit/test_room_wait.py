"""A new request waiting for room in target_model's KV cache (`RoomWait`, the loop's wait_for_room):
counted as queued once while it waits and not as live (nor at the verify gate), the waiters of an
instance asking in turn (arrival order, one at a time), a new request lining up behind them, the first
in line asking again as soon as a request of the instance releases its caches, refused at once with
when_full=reject, and ended by a cancellation from either source (the board for an ensemble's, the
response sender for a direct caller's), also while waiting for its turn."""

import asyncio
import concurrent.futures
import time

import pytest

from specdec.triton import orchestrator
from specdec.triton.orchestrator import RoomLine, RoomWait


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


class Slots:
    highest = 1


class Adapter:
    def __init__(self, when_full="queue"):
        self.when_full, self.cancellations, self.queued = when_full, Board(), 0
        self.ipc = concurrent.futures.ThreadPoolExecutor(1)
        self.gate, self.metrics, self.slots = Gate(), Metrics(), Slots()
        self.room = RoomLine()

    def count_queued(self, change):
        self.queued += change

    def report_live(self):
        self.metrics.set_live(self.gate.live, self.slots.highest)


class Sender:
    def __init__(self):
        self.cancelled = False

    def is_cancelled(self):
        return self.cancelled


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(orchestrator, "ROOM_RETRY_S", (0.001, 0.002))
    monkeypatch.setattr(orchestrator, "ROOM_CANCEL_POLL_S", 0.01)


def test_waits_counted_once_then_admitted():
    adapter = Adapter()
    room = RoomWait(adapter, 3, Sender())

    async def main():
        assert await room() and await room() and await room()
        assert adapter.queued == 1 and room.waits == 3
        assert adapter.gate.live == 0 and adapter.metrics.live == [0]  # waiting is not generating
        room.admitted()
        room.admitted()  # idempotent: every round and the request's end call it
        return adapter.queued

    assert asyncio.run(main()) == 0
    assert adapter.gate.live == 1 and adapter.metrics.live == [0, 1]


def test_reject_never_waits():
    adapter = Adapter("reject")
    room = RoomWait(adapter, 3, Sender())
    assert not asyncio.run(room()) and adapter.queued == 0 and not room.cancelled


@pytest.mark.parametrize("where", ["board", "sender"])
def test_a_cancellation_ends_the_wait(where):
    adapter, sender = Adapter(), Sender()
    room = RoomWait(adapter, 3, sender)

    async def main():
        assert await room()
        if where == "board":
            adapter.cancellations.cancelled.add(3)
        else:
            sender.cancelled = True
        assert not await room()
        room.admitted()

    asyncio.run(main())
    assert room.cancelled and adapter.queued == 0 and adapter.gate.live == 1


def test_only_the_first_waiter_asks_and_the_others_follow_in_arrival_order():
    adapter = Adapter()
    adapter.gate.live = 3
    rooms = [RoomWait(adapter, seq_id, Sender()) for seq_id in (1, 2, 3)]
    asked = []

    async def waiter(room, times):
        for _ in range(times):  # the loop's retries: each True is one more call to target_model
            assert await room()
            asked.append(room.seq_id)
        room.admitted()

    async def main():
        tasks = [asyncio.ensure_future(waiter(room, 3)) for room in rooms]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert asked == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # never two waiters asking in the same stretch
    assert adapter.queued == 0 and adapter.gate.live == 3 and not adapter.room.turn.locked() and adapter.room.length == 0


def test_a_waiter_cancelled_before_its_turn_leaves_the_line():
    adapter = Adapter()
    first, second = RoomWait(adapter, 1, Sender()), RoomWait(adapter, 2, Sender())

    async def main():
        assert await first()  # holds the turn
        waiting = asyncio.ensure_future(second())
        await asyncio.sleep(0.03)
        assert not waiting.done()
        adapter.cancellations.cancelled.add(2)
        assert not await waiting and second.cancelled
        second.admitted()  # the request's end
        first.admitted()
        third = RoomWait(adapter, 3, Sender())
        assert await third()  # the line moves on: nobody holds a stale turn
        third.admitted()

    asyncio.run(main())
    assert adapter.queued == 0 and not adapter.room.turn.locked() and adapter.room.length == 0


def test_a_new_request_lines_up_behind_the_waiters():
    adapter = Adapter()
    first, newcomer = RoomWait(adapter, 1, Sender()), RoomWait(adapter, 2, Sender())

    async def main():
        assert await newcomer.line_up() and not newcomer.queued  # no line: its first call goes at once
        newcomer.admitted()
        assert await first()  # no room for the first: it holds the turn
        late = RoomWait(adapter, 3, Sender())
        lining = asyncio.ensure_future(late.line_up())
        await asyncio.sleep(0.03)
        assert not lining.done() and late.queued and adapter.queued == 2  # behind the first, queued
        first.admitted()  # the first got its room
        assert await lining  # now it is the late one's turn to ask
        assert adapter.room.turn.locked()
        late.admitted()

    asyncio.run(main())
    assert adapter.queued == 0 and not adapter.room.turn.locked() and adapter.room.length == 0


def test_a_request_cancelled_in_line_never_asks():
    adapter = Adapter()
    first, late = RoomWait(adapter, 1, Sender()), RoomWait(adapter, 2, Sender())

    async def main():
        assert await first()
        lining = asyncio.ensure_future(late.line_up())
        await asyncio.sleep(0.02)
        adapter.cancellations.cancelled.add(2)
        assert not await lining and late.cancelled
        late.admitted()
        first.admitted()

    asyncio.run(main())
    assert adapter.queued == 0 and adapter.room.length == 0 and not adapter.room.turn.locked()


def test_a_release_wakes_the_first_in_line_before_its_back_off(monkeypatch):
    monkeypatch.setattr(orchestrator, "ROOM_RETRY_S", (5.0, 5.0))
    adapter = Adapter()
    room = RoomWait(adapter, 1, Sender())

    async def main():
        asyncio.get_running_loop().call_later(0.05, adapter.room.freed)  # another request ends
        started = time.monotonic()
        assert await room()
        woke = time.monotonic() - started
        # Released while it was asking (between two waits): it asks again without sleeping.
        adapter.room.freed()
        started = time.monotonic()
        assert await room()
        again = time.monotonic() - started
        room.admitted()
        return woke, again

    woke, again = asyncio.run(main())
    assert 0.04 < woke < 1.0 and again < 0.5
