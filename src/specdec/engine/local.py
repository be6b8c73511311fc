"""The loop's Proposer and Scorer over in-process `Executor`s: speculative decoding without a server.

What the Triton adapters do over BLS, done by direct calls; the tests and benchmarks run the real loop on
real models with it. Tensors come back to the host, as they do from a Triton model. Calls made by
concurrent `generate` runs in one turn of the event loop go to the executor as one batch (one forward for
all), as Triton's dynamic batcher gathers the served models' requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable

import torch

from specdec import tensor_names as tn
from specdec.decoding.interfaces import ForwardStats, NoCapacity, Proposal, ScoredRows, Scores, VerifyCall
from specdec.decoding.sampling import (SamplingParams, greedy, greedy_log_probs, make_generator, scored_rows,
                                      token_log_probs, top_log_probs)
from specdec.decoding.token_mask import allowed_greedy
from specdec.engine.errors import CapacityError
from specdec.engine.executor import Executor, Step
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.hosted_heads import HostedHeads


@contextlib.contextmanager
def _no_capacity():
    """The executor's CapacityError as the loop's NoCapacity (what a served model's UNAVAILABLE becomes)."""
    try:
        yield
    except CapacityError as exc:
        raise NoCapacity(str(exc)) from None


class _Batcher:
    """Gathers the steps that concurrent callers hand in during one turn of the event loop and runs them
    as one `*_many` call: every caller gets its own result (or the exception the whole call raised)."""

    def __init__(self, run_many: Callable[[list[Step]], list]):
        self.run_many = run_many
        self.pending: list[tuple[Step, asyncio.Future]] = []

    async def __call__(self, step: Step):
        loop = asyncio.get_running_loop()
        if not self.pending:  # runs after every caller already woken in this turn has handed its step in
            loop.call_soon(self._flush)
        future = loop.create_future()
        self.pending.append((step, future))
        return await future

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        try:
            results = self.run_many([step for step, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every caller of the batch sees it
            for _, future in batch:
                future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            future.set_result(result)


class LocalProposer:
    """Over an `Executor` (a draft model) or a `HeadExecutor` (a trained head: it reads the target's features)."""

    def __init__(self, lm: Executor | HeadExecutor, branches: int = 1):
        self.lm = lm
        self.wants_features = isinstance(lm, HeadExecutor)
        self.branches = branches  # candidates per drafted position (decoding/draft_tree.py): above 1, trees
        self.salted = True  # a request's prefix-cache salt reaches its steps (salt=)
        self._propose = _Batcher(lambda steps: self.lm.propose_many(steps))

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                      round_seed: int, reserve: int = 0, branches: int | None = None, salt: str = "",
                      **features) -> Proposal:
        generator = None if params.greedy else make_generator(round_seed, self.lm.logits_device)
        width = self.branches if branches is None else max(1, min(branches, self.branches))
        with _no_capacity():  # a head's features go with the step
            drafted = await self._propose(Step(seq_id, keep, new_ids, k=k, params=params, generator=generator,
                                               reserve=reserve, branches=width, salt=salt, **features))
            if isinstance(drafted, Exception):
                raise drafted
        probs = None if drafted.probs is None else drafted.probs.float().cpu()
        return Proposal(drafted.tokens, probs, drafted.cached_length, drafted.parents)

    async def release(self, seq_id: int) -> None:
        self.lm.release(seq_id)


class LocalScorer:
    """Over an `Executor` (the target); with `hosted`, heads in its process draft in the verify calls that ask
    (VerifyCall.draft), as a served target_model hosting them does."""

    def __init__(self, lm: Executor, hosted: HostedHeads | None = None):
        self.lm, self.hosted = lm, hosted
        self._plain = _Batcher(lambda steps: self.lm.extend_many(steps))
        self._with_hidden = _Batcher(lambda steps: self.lm.extend_many(steps, with_hidden=True))
        self._drafting = _Batcher(self._draft_and_extend)

    def _draft_and_extend(self, steps: list[Step]) -> list:
        """The hosted heads' steps: each drafts, then one forward verifies; per step (result, proposal or None,
        the forward's seconds without the drafting)."""
        started = time.perf_counter()
        results, drafted, drafting = self.hosted.verify(self.lm, steps)
        seconds = time.perf_counter() - started - drafting
        return [(result, drafted.get(step.seq_id), seconds) for step, result in zip(steps, results)]

    async def score(self, call: VerifyCall) -> Scores:
        ask = call.draft
        if ask is not None and self.hosted is None:
            raise ValueError(f"no hosted head {ask.head!r} (this scorer hosts none)")
        step = Step(call.seq_id, call.keep, call.new_ids, call.num_positions + call.score_rows, reserve=call.reserve,
                    whole=call.want_features or ask is not None,  # a head reads every position's features
                    tree=call.tree, path=call.path, score_rows=call.score_rows,
                    adapter=call.adapter, salt=call.salt)  # the sequence's LoRA adapter by name, its salt
        if ask is not None:
            head = self.hosted.heads.get(ask.head)
            generator = None if ask.params.greedy or head is None else make_generator(ask.seed, head.logits_device)
            step = step._replace(draft_head=ask.head, k=ask.k, params=ask.params, generator=generator,
                                 branches=ask.branches)
        problem = call.adapter and (self.lm.adapters.problem(call.adapter) if self.lm.adapters else
                                    f"no LoRA adapter {call.adapter!r} (this executor serves none)")
        if problem:
            raise ValueError(problem)
        started = time.perf_counter()
        proposal = None
        with _no_capacity():
            if ask is not None:
                result, drafted, seconds = await self._drafting(step)
                if drafted is not None:
                    drafted, stats = drafted
                    probs = None if drafted.probs is None else drafted.probs.float().cpu()
                    proposal = Proposal(drafted.tokens, probs, 0, drafted.parents, stats)
            else:
                result = await (self._with_hidden if call.want_features else self._plain)(step)
            if isinstance(result, Exception):
                raise result
        if self.lm.device.type == "cuda":  # the forward's time, not its launch's
            torch.cuda.current_stream(self.lm.device).synchronize()
        # timed as the served target times its forward (language_models.py): the draft-length policy prices
        # verifies from these quietest times, not from the noisier call latencies
        if ask is None:
            seconds = time.perf_counter() - started
        logits, features = (result.logits, result.hidden.flatten(1).cpu()) if call.want_features else \
            (result.logits if ask is not None else result, None)
        scored = None
        if call.score_rows:  # the rows before the verified positions score the new tokens after them
            values, ranks, ids, tops = scored_rows(logits, call.new_ids, call.score_rows,
                                                   tn.MAX_TOP_LOG_PROBS if call.score_top else 0)
            scored = ScoredRows(values.cpu(), ranks.cpu(), None if ids is None else ids.cpu(),
                                None if tops is None else tops.cpu(),
                                logits[:call.score_rows].float().cpu() if call.score_logits else None)
            logits = logits[call.score_rows:]
        allowed = call.allowed
        tokens = greedy(logits) if allowed is None else allowed_greedy(logits, allowed)
        log_probs = top_ids = top_values = None
        if call.want_top_log_probs:
            top_ids, top_values = (t.cpu() for t in top_log_probs(logits, tn.MAX_TOP_LOG_PROBS))
        if call.want_log_probs:  # a greedy token's is its row's first of the top ones (the same bits)
            log_probs = (top_values[:, 0] if top_values is not None and allowed is None else
                         greedy_log_probs(logits) if allowed is None else token_log_probs(logits, tokens))
        rows = len(call.new_ids) + (len(proposal.tokens) if proposal is not None else 0)
        return Scores(tokens.cpu(), logits.float().cpu() if call.want_logits else None,
                      ForwardStats(rows, 1, seconds), None if log_probs is None else log_probs.cpu(), features,
                      top_ids, top_values, scored, self._cached(call), self.lm.block_size, proposal)

    def _cached(self, call: VerifyCall) -> int | None:
        seq = self.lm.sequences.get(call.seq_id) if call.keep == 0 else None
        return None if seq is None else seq.cached

    async def release(self, seq_id: int) -> None:
        self.lm.release(seq_id)
        if self.hosted is not None:
            self.hosted.release(seq_id)


async def collect(rounds) -> list[int]:
    """Every token a `generate` run emits."""
    return [token async for rnd in rounds for token in rnd.new_tokens]
