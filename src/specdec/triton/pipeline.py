"""A model's steps run off Triton's execute thread (`pipelined_execute`), so host work overlaps the forwards.

Synchronously, a model instance is busy from the moment Triton hands it a batch until its responses are
back: parsing the requests, the forward, the wait for the device, building and shipping the responses,
all in one thread and one after another. Triton starts the next execution only then, so with concurrent
streams the host work between two forwards is time the device sits idle.

Pipelined, `execute` only parses its requests into jobs, hands them over and returns None (a
non-decoupled model may answer through each request's response sender, exactly one final response each):
Triton hands over the next batch at once. One thread, the runner, takes every job queued so far as one
batch (one forward: the sequences that arrived while the last forward ran share the next), and another,
the responder, builds and sends the previous batch's responses while the runner starts the next forward.

A job names its sequence; a batch holds at most one job per sequence (a step and a release of the same
sequence are run in the order they came, in consecutive batches). Every job gets exactly one answer, also
when its batch fails or the model unloads with jobs queued: no caller waits forever.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any, Callable, NamedTuple


class Job(NamedTuple):
    request: Any  # the Triton request, answered through its response sender
    seq_id: int
    step: Any = None  # what to run; None with no error: release the sequence
    error: Exception | None = None  # a request that failed parsing is answered with its error


class Pipeline:
    """`run(jobs) -> outcomes` (on the runner thread, one outcome per job: a result or an Exception),
    `answer(job, outcome) -> response` and `send(job, response)` (on the responder thread; `answer` must
    not raise: its errors are the responses)."""

    def __init__(self, name: str, run: Callable[[list[Job]], list], answer: Callable[[Job, Any], Any],
                 send: Callable[[Job, Any], None], log: Callable[[str], None]):
        self._run, self._answer, self._send, self._log = run, answer, send, log
        self._pending: collections.deque[Job] = collections.deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._runner = threading.Thread(target=self._run_batches, daemon=True, name=f"{name}-runner")
        self._responder = threading.Thread(target=self._respond, daemon=True, name=f"{name}-responder")
        self._runner.start()
        self._responder.start()

    def submit(self, jobs: list[Job]) -> None:
        with self._ready:
            if not self._stopping:
                self._pending.extend(jobs)
                self._ready.notify()
                return
        for job in jobs:  # unloading: answered here, the responder may be gone
            self._send(job, self._answer(job, RuntimeError("the model is unloading")))

    def _take(self) -> list[Job] | None:
        """Every queued job, one per sequence (the rest stay queued, in order); None once stopping."""
        with self._ready:
            while not self._pending and not self._stopping:
                self._ready.wait()
            if self._stopping:
                return None
            batch, later, seen = [], collections.deque(), set()
            for job in self._pending:
                (later if job.seq_id in seen else batch).append(job)
                seen.add(job.seq_id)
            self._pending = later
            return batch

    def _run_batches(self) -> None:
        while (batch := self._take()) is not None:
            try:
                outcomes = self._run(batch)
            except BaseException as exc:  # noqa: BLE001 - the batch fails, the thread goes on serving
                outcomes = [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(batch)
            self._answers.put((batch, outcomes))

    def _respond(self) -> None:
        while (item := self._answers.get()) is not None:
            for job, outcome in zip(*item):
                try:
                    self._send(job, self._answer(job, outcome))
                except Exception as exc:  # noqa: BLE001 - one lost response must not stop the others
                    self._log(f"could not answer sequence {job.seq_id}: {type(exc).__name__}: {exc}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the batch in flight, answer the jobs still queued with an error, stop both threads."""
        with self._ready:
            self._stopping = True
            left, self._pending = list(self._pending), collections.deque()
            self._ready.notify_all()
        self._runner.join(timeout_s)
        if left:
            self._answers.put((left, [RuntimeError("the model is unloading")] * len(left)))
        self._answers.put(None)
        self._responder.join(timeout_s)
