"""The live-sequence cap shared by orchestrator instances: slots are file locks, so two pools over one
directory (two instances) share the cap, their waiters form one line in arrival order, and a process
that dies frees what it held."""

import asyncio
import subprocess
import sys
import textwrap

import pytest

from specdec.triton.admission.sequence_slots import SlotPool


def test_two_pools_share_the_cap(tmp_path):
    a, b = SlotPool(3, tmp_path), SlotPool(3, tmp_path)
    held = [a.try_acquire(), b.try_acquire(), a.try_acquire()]
    assert None not in held
    assert b.try_acquire() is None and a.try_acquire() is None
    SlotPool.release(held[0])
    again = b.try_acquire()
    assert again is not None and a.try_acquire() is None
    for fd in held[1:] + [again]:
        SlotPool.release(fd)
    assert [a.try_acquire() for _ in range(3)].count(None) == 0


def test_lowest_slot_first_gives_the_peak(tmp_path):
    a, b = SlotPool(4, tmp_path), SlotPool(4, tmp_path)
    first = a.try_acquire()
    assert a.highest == 1
    second = b.try_acquire()
    assert b.highest == 2  # slot 0 was held by the other pool: two at once
    SlotPool.release(first)
    SlotPool.release(second)
    fd = b.try_acquire()
    assert (a.highest, b.highest) == (1, 2)  # a high-water mark: it never falls
    SlotPool.release(fd)


def test_a_waiter_gets_the_slot_another_pool_frees(tmp_path):
    a, b = SlotPool(1, tmp_path, poll_s=0.001), SlotPool(1, tmp_path, poll_s=0.001)
    held = a.try_acquire()

    async def scenario():
        waiter = asyncio.ensure_future(b.acquire())
        await asyncio.sleep(0.02)
        assert not waiter.done()
        SlotPool.release(held)
        assert a.take_now() is None  # free, but a request of the other instance waits for it: no passing
        return await asyncio.wait_for(waiter, 2)

    fd = asyncio.run(scenario())
    assert a.try_acquire() is None
    SlotPool.release(fd)
    fd = a.take_now()  # nobody waits any more
    assert fd is not None
    SlotPool.release(fd)


@pytest.mark.parametrize("instances", [1, 2])
def test_waiters_go_in_arrival_order(tmp_path, instances):
    """One line for the server: whichever instance a request waits in, the slot goes to the first to come.
    With two, the second polls 20x as often: without one line its waiters would take every slot first."""
    pools = [SlotPool(1, tmp_path, poll_s=0.02), SlotPool(1, tmp_path, poll_s=0.001)][:instances]
    held = pools[0].try_acquire()
    order = []

    async def wait(pool, name):
        fd = await pool.acquire()
        order.append(name)
        await asyncio.sleep(0.005)
        SlotPool.release(fd)

    async def scenario():
        tasks = []
        for i, name in enumerate("abcd"):  # alternating instances
            tasks.append(asyncio.ensure_future(wait(pools[i % instances], name)))
            await asyncio.sleep(0.005)
        SlotPool.release(held)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    asyncio.run(scenario())
    assert order == ["a", "b", "c", "d"]
    assert not pools[0].line.waiting()


@pytest.mark.parametrize("instances", [1, 2])
def test_waiters_go_by_priority_then_arrival(tmp_path, instances):
    """A lower priority value goes first, whichever instance it waits in and however late it came; equal
    priorities in arrival order. In one instance the latecomer waits behind its own process's earlier
    waiters until the line is read again: it must still pass them (no waiter holds a turn it cannot use)."""
    pools = [SlotPool(1, tmp_path, poll_s=0.02), SlotPool(1, tmp_path, poll_s=0.001)][:instances]
    held = pools[0].try_acquire()
    order = []

    async def wait(pool, name, priority):
        fd = await pool.acquire(priority=priority)
        order.append(name)
        await asyncio.sleep(0.005)
        SlotPool.release(fd)

    async def scenario():
        tasks = []
        for i, (name, priority) in enumerate([("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0)]):
            tasks.append(asyncio.ensure_future(wait(pools[i % instances], name, priority)))
            await asyncio.sleep(0.005)
        SlotPool.release(held)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    asyncio.run(scenario())
    assert order == ["d", "b", "e", "a", "c"]
    assert not pools[0].line.waiting()


def test_a_cancelled_waiter_takes_no_slot(tmp_path):
    pool = SlotPool(1, tmp_path, poll_s=0.001)
    held = pool.try_acquire()

    async def scenario():
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())
    assert not pool.line.waiting()  # nor its place in line
    SlotPool.release(held)
    fd = pool.take_now()
    assert fd is not None  # the cancelled waiter holds nothing
    SlotPool.release(fd)


def test_a_waiter_whose_request_is_cancelled_leaves_the_line(tmp_path, monkeypatch):
    """A direct caller that cancels while its request waits for a slot: asked every CANCEL_CHECK_S, the
    waiter gives up its place (None), whether it was first in line or behind its instance's earlier
    waiter, and the others keep their order."""
    from specdec.triton.admission import ticket_line as line_module

    monkeypatch.setattr(line_module, "CANCEL_CHECK_S", 0.01)
    pool = SlotPool(1, tmp_path, poll_s=0.001)
    held = pool.try_acquire()
    cancelled = set()
    asked = []

    async def wait(name):
        async def is_cancelled():
            asked.append(name)
            return name in cancelled
        return name, await pool.acquire(is_cancelled)

    async def scenario():
        first, second, third = (asyncio.ensure_future(wait(name)) for name in "abc")
        await asyncio.sleep(0.05)
        assert {"a", "b"} <= set(asked)  # the first in line and one waiting for its turn both ask
        cancelled.update("ab")
        assert await asyncio.wait_for(first, 1) == ("a", None)  # first in line
        assert await asyncio.wait_for(second, 1) == ("b", None)  # behind it in this instance
        assert not third.done()  # still waits: nothing was freed
        SlotPool.release(held)
        name, fd = await asyncio.wait_for(third, 1)
        return fd

    fd = asyncio.run(scenario())
    assert fd is not None and not pool.line.waiting()
    SlotPool.release(fd)


def test_a_dead_process_frees_its_slots(tmp_path):
    """A stub that crashes holding slots does not shrink the cap for the instances that remain."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from specdec.triton.admission.sequence_slots import SlotPool
        pool = SlotPool(2, Path({str(tmp_path)!r}))
        held = [pool.try_acquire(), pool.try_acquire()]
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        pool = SlotPool(2, tmp_path)
        assert pool.try_acquire() is None
        holder.kill()
        holder.wait(10)
        fds = [pool.try_acquire(), pool.try_acquire()]
        assert None not in fds
        for fd in fds:
            SlotPool.release(fd)
    finally:
        holder.kill()


def test_at_least_one_slot(tmp_path):
    with pytest.raises(ValueError, match="at least one slot"):
        SlotPool(0, tmp_path)


def test_a_newcomer_does_not_pass_the_waiters(tmp_path):
    """`take_now` gives a free slot only while nobody of this process waits: a request arriving just after
    a release cannot take the slot a queued one polls for."""
    pool = SlotPool(1, tmp_path, poll_s=0.05)
    held = pool.try_acquire()

    async def scenario():
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        SlotPool.release(held)
        assert pool.take_now() is None  # free, but the waiter is first
        return await asyncio.wait_for(waiter, 2)

    fd = asyncio.run(scenario())
    assert pool.take_now() is None  # held by the waiter now
    SlotPool.release(fd)
    fd = pool.take_now()
    assert fd is not None
    SlotPool.release(fd)
