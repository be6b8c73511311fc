"""Lining up concurrent requests' verify calls, so that target_model runs them as one forward.

Every live request of an orchestrator runs in one event loop and handles its previous round's answer
in turn, so their verify calls leave spread out, and target_model's sequence batcher (no queue delay)
starts a forward with whoever has arrived: on the H100, 8 streams' forwards carried 3.7 sequences on
average, in groups that alternate. The gate holds a verify call until every live
request waits at it, or until `window_s` has passed since the first one did; then they all go. A
single stream never waits; with several, a forward can carry all of them, and the window bounds what a
request waits for one that is slow (drafting, or finishing).

Plain asyncio, no Triton: unit-tested with fake scorers.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar

if TYPE_CHECKING:  # annotations only: the launcher imports this package's room counters without torch
    from specdec.decoding.interfaces import Scorer, Scores, VerifyCall

T = TypeVar("T")


class VerifyGate:
    def __init__(self, window_s: float, on_hold: Callable[[], None] = lambda: None):
        self.window_s = window_s
        self.on_hold = on_hold  # called for every verify call that waits (the orchestrator counts them)
        self.live = 0  # requests generating: the orchestrator counts them in and out
        self._waiting: list[asyncio.Future] = []
        self._timer: asyncio.TimerHandle | None = None

    def enter(self) -> None:
        self.live += 1

    def leave(self) -> None:
        self.live -= 1
        self._open_if_everyone_waits()

    async def through(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` (a verify) once the gate opens."""
        if self.window_s > 0 and self.live > 1:
            loop = asyncio.get_running_loop()
            arrived = loop.create_future()
            self._waiting.append(arrived)
            if self._timer is None:
                self._timer = loop.call_later(self.window_s, self._open)
            self._open_if_everyone_waits()
            if not arrived.done():
                self.on_hold()
                try:
                    await arrived
                except asyncio.CancelledError:
                    if arrived in self._waiting:
                        self._waiting.remove(arrived)
                    raise
        return await call()

    def _open_if_everyone_waits(self) -> None:
        if self._waiting and len(self._waiting) >= self.live:
            self._open()

    def _open(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        for arrived in waiting:
            if not arrived.done():
                arrived.set_result(None)


class GatedScorer:
    """A Scorer whose verify calls pass the gate; releases go straight through."""

    def __init__(self, scorer: Scorer, gate: VerifyGate):
        self.scorer, self.gate = scorer, gate

    async def score(self, call: VerifyCall) -> Scores:
        return await self.gate.through(lambda: self.scorer.score(call))

    async def release(self, seq_id: int) -> None:
        await self.scorer.release(seq_id)
