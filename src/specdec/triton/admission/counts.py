"""This orchestrator instance's requests by state: the one owner of the counts its gauges show.

A request is queued while it waits for a live-sequence slot or for KV room, and live while it generates.
The live count is also the verify gate's (it holds verifies until every live request waits there) and
the load check's (`max_drafting_sequences`), so it is kept by the gate and moved only from here.
"""

from __future__ import annotations

from typing import Callable

from specdec.triton.admission.verify_gate import VerifyGate


class RequestCounts:
    def __init__(self, gate: VerifyGate, publish: Callable[[int, int], None] = lambda live, queued: None):
        self.gate = gate
        self.queued = 0
        self._publish = publish  # (live, queued) -> the gauges, after every change

    @property
    def live(self) -> int:
        return self.gate.live

    def started(self) -> None:
        """A request begins generating."""
        self.gate.enter()
        self._changed()

    def ended(self) -> None:
        """A generating request is over."""
        self.gate.leave()
        self._changed()

    def waiting(self, change: int) -> None:
        """A request that is not generating yet starts (+1) or stops (-1) waiting for a slot."""
        self.queued += change
        self._changed()

    def queue(self) -> None:
        """A live request waits for KV room: queued, and no longer live (nor at the gate, which would
        otherwise hold the others' verifies for it)."""
        self.gate.leave()
        self.queued += 1
        self._changed()

    def admit(self) -> None:
        """A request that waited for KV room has it: live again."""
        self.gate.enter()
        self.queued -= 1
        self._changed()

    def _changed(self) -> None:
        self._publish(self.gate.live, self.queued)
