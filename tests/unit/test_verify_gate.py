"""The verify gate: concurrent requests' verify calls leave together; a single stream never waits; the
window bounds every wait."""

import asyncio
import time

import pytest

from specdec.decoding.interfaces import VerifyCall
from specdec.triton.admission.verify_gate import GatedScorer, VerifyGate

LONG = 5.0  # a window no test should ever wait out, unless it means to


class Counted(VerifyGate):
    """A gate that counts its holds the way the orchestrator's metric does."""

    def __init__(self, window_s):
        super().__init__(window_s, on_hold=self._hold)
        self.held = 0

    def _hold(self):
        self.held += 1


def run(coro):
    return asyncio.run(coro)


def test_a_single_stream_never_waits():
    async def main():
        gate = Counted(LONG)
        gate.enter()
        started = time.monotonic()
        assert await gate.through(lambda: asyncio.sleep(0, result="scored")) == "scored"
        return time.monotonic() - started, gate.held
    elapsed, held = run(main())
    assert elapsed < 0.5 and held == 0


def test_verify_calls_leave_together_once_every_live_request_waits():
    async def main():
        gate = Counted(LONG)
        for _ in range(3):
            gate.enter()
        sent = []

        async def request(name, delay):
            await asyncio.sleep(delay)  # each handles its previous answer for a different time
            return await gate.through(lambda: asyncio.sleep(0, result=sent.append((name, time.monotonic()))))

        started = time.monotonic()
        await asyncio.gather(request("a", 0.0), request("b", 0.05), request("c", 0.2))
        return started, sent, gate.held
    started, sent, held = run(main())
    assert sorted(name for name, _ in sent) == ["a", "b", "c"]
    times = [at for _, at in sent]
    assert min(times) - started >= 0.19  # a and b waited for c ...
    assert max(times) - min(times) < 0.05  # ... and all three left together
    assert held == 2


def test_the_window_bounds_the_wait_for_a_slow_request():
    async def main():
        gate = Counted(0.1)
        gate.enter(), gate.enter()  # the other request is drafting and never comes
        started = time.monotonic()
        await gate.through(lambda: asyncio.sleep(0))
        return time.monotonic() - started
    assert 0.09 <= run(main()) < 0.5


def test_a_request_that_ends_releases_those_waiting_for_it():
    async def main():
        gate = Counted(LONG)
        gate.enter(), gate.enter()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, gate.leave)
        started = time.monotonic()
        await gate.through(lambda: asyncio.sleep(0))
        return time.monotonic() - started
    assert run(main()) < 0.5


def test_window_zero_never_holds():
    async def main():
        gate = Counted(0.0)
        gate.enter(), gate.enter()
        await gate.through(lambda: asyncio.sleep(0))
        return gate.held
    assert run(main()) == 0


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        gate = Counted(LONG)
        for _ in range(3):
            gate.enter()
        waiter = asyncio.ensure_future(gate.through(lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return len(gate._waiting)
    assert run(main()) == 0


def test_gated_scorer_passes_scores_and_releases_through():
    class Fake:
        def __init__(self):
            self.calls = []

        async def score(self, call):
            self.calls.append(("score", call))
            return "scores"

        async def release(self, seq_id):
            self.calls.append(("release", seq_id))

    async def main():
        fake = Fake()
        gate = Counted(LONG)
        gate.enter()
        scorer = GatedScorer(fake, gate)
        assert await scorer.score(first) == "scores"
        assert await scorer.score(second) == "scores"
        await scorer.release(7)
        return fake.calls
    first = VerifyCall(7, 3, [1, 2], 2, want_logits=True)
    second = VerifyCall(8, 0, [1, 2], 1, reserve=30, want_log_probs=True, allowed="bits")
    assert run(main()) == [("score", first), ("score", second), ("release", 7)]
