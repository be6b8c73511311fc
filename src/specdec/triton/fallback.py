"""A draft model that fails does not fail the request: the round runs target-only instead.

`FallbackProposer` wraps a BLS proposer. When a propose call raises (the draft model errored, timed out,
is unloaded or out of sequence slots), the round gets no draft tokens, which the loop verifies as a
plain target-only step: greedy output is unchanged and sampling stays exact, only slower. The draft's
cache for that sequence is dropped (its state after a failed call is unknown) and rebuilt from the
prompt when drafting resumes. After a failure the draft is out of rotation for `retry_after_s`, doubling
while it keeps failing (up to `max_retry_after_s`, 8 s: a draft the launcher's watchdog has reloaded
is back in rotation within seconds, and probing one that stays dead costs one failed call per 8 s): no
request waits on a dead draft, and the first call after the wait is the probe that brings it back.

A draft without room for a new sequence (NoCapacity: its KV budget is full) is not failing: that one
sequence runs target-only rounds and asks again after `retry_after_s`, the draft stays in rotation.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from specdec.decoding.interfaces import NoCapacity, Proposal, Proposer
from specdec.decoding.sampling import SamplingParams


class FallbackProposer:
    def __init__(self, inner: Proposer, name: str, on_fallback: Callable[[str], None] = lambda name: None,
                 retry_after_s: float = 1.0, max_retry_after_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic):
        self.inner, self.name, self.on_fallback, self.clock = inner, name, on_fallback, clock
        self.initial_wait, self.max_wait = retry_after_s, max_retry_after_s
        self.wait = retry_after_s
        self.out_until = 0.0  # the draft is out of rotation until then
        self.fallbacks = 0  # rounds that ran target-only because the draft failed or was out
        self.no_room_until: dict[int, float] = {}  # sequences the draft had no room for, until when
        self.wants_features = getattr(inner, "wants_features", False)  # a trained head's: the loop sends them
        self.branches = getattr(inner, "branches", 1)  # its trees' width: the policy chooses per round
        self.adapts = getattr(inner, "adapts", False)  # it takes a request's LoRA adapter (adapter=)
        self.salted = getattr(inner, "salted", False)  # and its prefix-cache salt (salt=)

    @property
    def available(self) -> bool:
        return self.clock() >= self.out_until

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                      round_seed: int, reserve: int = 0, **options) -> Proposal:
        if not self.available or self.no_room_until.get(seq_id, 0.0) > self.clock():
            return self._fallback(keep)
        try:
            proposal = await self.inner.propose(seq_id, keep, new_ids, k, params, round_seed, reserve, **options)
        except NoCapacity:
            await self.release(seq_id)  # ends the sequence the call started at Triton's batcher
            self.no_room_until[seq_id] = self.clock() + self.initial_wait
            return self._fallback(0)
        except Exception as exc:  # noqa: BLE001 - any draft failure: this round goes target-only
            print(f"[specdec] draft {self.name!r} failed, out of rotation for {self.wait:.1f} s: {exc}",
                  file=sys.stderr, flush=True)
            self.out_until = self.clock() + self.wait
            self.wait = min(2 * self.wait, self.max_wait)
            await self.release(seq_id)
            return self._fallback(0)
        self.wait = self.initial_wait  # it answered: back in rotation at the normal wait
        return proposal

    def _fallback(self, cached_length: int) -> Proposal:
        self.fallbacks += 1
        self.on_fallback(self.name)
        return Proposal([], None, cached_length)

    async def release(self, seq_id: int) -> None:
        self.no_room_until.pop(seq_id, None)
        try:
            await self.inner.release(seq_id)
        except Exception as exc:  # noqa: BLE001 - a release that fails must not keep the target's cache
            print(f"[specdec] draft {self.name!r}: releasing sequence {seq_id} failed: {exc}", file=sys.stderr,
                  flush=True)
