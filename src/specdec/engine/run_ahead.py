"""Running a sequence's next greedy step before it is asked for, so the device works while the host serves.

A served target-only round is a forward (~5 ms for an 8B model on an H100-class GPU) plus ~2 ms of host
machinery (the adapter, Triton, the orchestrator's BLS call and its response) during which the GPU idles.
When a greedy step's only output is its token, the next step's input is that token, known on the device
before the host has seen it: the executor appends it and runs the next forward at once (`Executor.run_ahead`),
and the next request, when it asks for exactly that step, takes the logits already computed instead of
running it again. The GPU then runs forward after forward while the machinery of each round overlaps the
next round's forward (what SGLang's overlap scheduler does for its batches). A request that asks for
anything else (another token count, a rollback, a tree, other outputs) drops the step: its keys and values
lie past the sequence's kept length, overwritten like a rejected draft token's.

A head hosted in the target's process (hosted_heads.py) runs a greedy round ahead too: its round's greedy
picks say which drafts the orchestrator accepts and the token it adds, so the next round's call is known
but for its K; the head drafts that round at this round's K and the target verifies it at once
(`Executor.run_ahead_step`). The next call takes it where it asks for the same tokens, or for fewer drafts
(every row's logits are there: it takes the first ones), or for more where the chain ended before its K
(the confidence stop ends a fresh chain at the same token; target_model's `_take_ahead` decides that).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch


class Ahead(NamedTuple):
    """A step run ahead for one sequence: what the request that takes it must ask for, and its results."""

    start: int  # the sequence's length before the step (the request's cache_length)
    tokens: tuple[int, ...]  # the tokens it appended (a target-only step's one; a hosted head's round: more)
    logits: torch.Tensor  # (num_logits, V) as extend returns them
    hidden: torch.Tensor | None  # (len(tokens), layers, H) with hidden_layers
    timer: "ForwardTimer"

    def matches(self, step) -> bool:
        """Whether `step` (an `interfaces.Step`) asks for this one: the same tokens and logits, or (where it
        has every row's logits: a hosted head's round asking for fewer drafts than it guessed) a prefix of
        its tokens and logits of some of those rows, the last ones."""
        n = len(step.new_ids)
        if step.keep != self.start or step.tree is not None or step.path is not None or not 1 <= n <= len(self.tokens):
            return False
        if [int(token) for token in step.new_ids] != list(self.tokens[:n]):
            return False
        if n == len(self.tokens) and step.num_logits == len(self.logits):
            return True
        return len(self.logits) == len(self.tokens) and step.num_logits <= n

    def rows(self, step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (logits, hidden) `step` (one it matches) asks for: those of its tokens' rows."""
        n = len(step.new_ids)
        if n == len(self.tokens) and step.num_logits == len(self.logits):
            return self.logits, self.hidden
        return self.logits[n - step.num_logits:n], None if self.hidden is None else self.hidden[:n]


class ForwardTimer:
    """How long a forward took on its device: CUDA events around it (read once it is done, without
    waiting for work queued after it), or the host's clock on CPU, where a forward is synchronous."""

    def __init__(self, device: torch.device):
        self.device = device
        self._events = None
        self._seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> "ForwardTimer":
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._started

    def seconds(self) -> float:
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3
