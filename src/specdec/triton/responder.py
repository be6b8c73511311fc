"""A model's responses built and sent off Triton's execute thread (`pipelined_execute`).

Synchronously, a model instance is busy from the moment Triton hands it a batch until its responses are
back: parsing the requests, the forward, building the responses and shipping them to the server, one
after another. Triton hands the instance its next batch only then, so under concurrent streams the
response work is time between two forwards.

Pipelined, `execute` parses and runs its batch as before, hands the outcomes to the responder and returns
None (a non-decoupled Python model may answer through each request's response sender, exactly one final
response per request; checked with Triton 24.10): Triton hands over the next batch at once, and its
forward runs while the responder builds and sends the last one's responses. The forward stays in the
stub's own thread: run from another thread, the tiny pair's served forward on CPU took 1.5x as long.

Every job gets exactly one answer, also when the model unloads with answers still queued.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, NamedTuple


class Job(NamedTuple):
    request: Any  # the Triton request, answered through its response sender
    seq_id: int
    step: Any = None  # what to run; None with no error: release the sequence
    error: Exception | None = None  # a request that failed parsing is answered with its error


class Responder:
    """`answer(job, outcome) -> response` and `send(job, response)`, on a thread of its own, for each job
    of the batches submitted, in order; `answer` must not raise (its errors are the responses)."""

    def __init__(self, name: str, answer: Callable[[Job, Any], Any], send: Callable[[Job, Any], None],
                 log: Callable[[str], None]):
        self._answer, self._send, self._log = answer, send, log
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._respond, daemon=True, name=f"{name}-responder")
        self._thread.start()

    def submit(self, jobs: list[Job], outcomes: list) -> None:
        with self._lock:
            if not self._stopped:
                self._batches.put((jobs, outcomes))
                return
        self._answer_all(jobs, outcomes)  # stopped: answered here

    def _respond(self) -> None:
        while (batch := self._batches.get()) is not None:
            self._answer_all(*batch)

    def _answer_all(self, jobs: list[Job], outcomes: list) -> None:
        for job, outcome in zip(jobs, outcomes):
            try:
                self._send(job, self._answer(job, outcome))
            except Exception as exc:  # noqa: BLE001 - one lost response must not stop the others
                self._log(f"could not answer sequence {job.seq_id}: {type(exc).__name__}: {exc}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the thread (later batches are answered by `submit` itself)."""
        with self._lock:
            self._stopped = True
            self._batches.put(None)
        self._thread.join(timeout_s)
