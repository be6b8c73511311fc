"""Trained heads drafting in the target's own process: a round is one call, draft and verify.

A head served as a draft model (draft_model with `draft_kind: head`) costs a round two calls: the
orchestrator hands the head the target's features of the positions the last round kept and asks for a
proposal, then asks the target to verify it. Hosted here, the target's call does both: the head drafts
from the features the target's earlier forwards left in this process (kept here, never sent), its
proposal is appended to the call's new tokens (`Step.draft_head` names the head), the one forward
verifies them, and the proposal goes back with the scores; the orchestrator still decides what is
accepted, as for any draft. A round saves a call's serving machinery (BLS, Triton, the head's adapter)
and the features' trip between processes; the head borrows the target's embedding, the same tensor
(draft_heads.shared_target_tensors), where a head in a process of its own holds a copy.

Per sequence it keeps the tokens the target's cache holds and the features the head has not read, cut at
each call to what the call keeps of the previous one (its `keep`, a tree's accepted `path`): what the
decode loop does for a head it calls (decoding/features.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.decoding.features import Features, rows_on, with_catch_up
from specdec.decoding.interfaces import ForwardStats
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.interfaces import Drafted, Scored, Step


@dataclass
class _Hosted:
    """One sequence's side of its head: the tokens the target's cache holds (and, after a call, what it
    appended: the previous call's new tokens, drafted ones included, until the next call says what stays),
    and the features the head has not read."""

    head: str
    tokens: list[int] = field(default_factory=list)
    features: Features = field(default_factory=Features)
    # the previous call: its first new position, its new tokens' count and tree, its features' rows
    pending: tuple[int, int, tuple[int, ...] | None, torch.Tensor | None] | None = None


@dataclass
class HeadTotals:
    """One hosted head's work since load, what target_model's metrics report (specdec_hosted_head_*)."""

    seconds: float = 0.0  # drafting, its forwards and picks (the target's forward time leaves it out)
    proposals: int = 0  # sequences' proposals asked of it
    tokens: int = 0  # tokens it drafted
    failures: int = 0  # drafting calls that raised (their rounds drafted nothing)


class HostedHeads:
    """heads: name -> HeadExecutor; columns: name -> the head's layers among the target's served ones
    (index into the features' layer axis; None: all of them, in order)."""

    def __init__(self, heads: dict[str, HeadExecutor], columns: dict[str, torch.Tensor | None]):
        self.heads, self.columns = heads, columns
        self.sequences: dict[int, _Hosted] = {}
        self.totals = {name: HeadTotals() for name in heads}
        self.last_failure = ""  # the last drafting call's error, where one raised

    @property
    def failures(self) -> int:
        """Every head's drafting calls that raised (their rounds drafted nothing)."""
        return sum(totals.failures for totals in self.totals.values())

    def draft(self, steps: list[Step]) -> tuple[list[Step], dict[int, tuple[Drafted, ForwardStats]]]:
        """Before the target's forward: each step naming a hosted head brings its sequence up to the call's
        keep and new tokens, and with k > 0 its head drafts. Returns the steps to run (a proposal appended
        to its step's new tokens, num_logits and tree over them) and, by sequence, each proposal with the
        head's execution (its rows, sequences and seconds: every head's, where several drafted)."""
        asks: dict[str, list[int]] = {}
        for i, step in enumerate(steps):
            if not step.draft_head:
                continue
            if step.draft_head not in self.heads:
                raise ValueError(f"no hosted head {step.draft_head!r} (this target hosts "
                                 f"{', '.join(self.heads) or 'none'})")
            self._catch_up(step)
            if step.k > 0 and not step.score_rows and step.tree is None:
                asks.setdefault(step.draft_head, []).append(i)
        drafted: dict[int, tuple[Drafted, ForwardStats]] = {}
        steps = list(steps)
        for name, indices in asks.items():
            head = self.heads[name]
            calls = [self._head_step(head, steps[i]) for i in indices]
            started = time.perf_counter()
            try:
                results = head.propose_many(calls)
                if head.device.type == "cuda":
                    torch.cuda.current_stream(head.device).synchronize()
            except Exception as exc:  # noqa: BLE001 - the head's failure is its own: the verifies go on
                self.totals[name].failures += 1
                self.last_failure = f"{type(exc).__name__}: {exc}"
                for call in calls:  # its side of these sequences starts over (features it no longer has
                    # read as zeros: worse drafts, never wrong ones)
                    head.release(call.seq_id)
                results = [exc] * len(calls)
            stats = ForwardStats(sum(len(call.new_ids) + call.k for call in calls), len(calls),
                                 time.perf_counter() - started)
            totals = self.totals[name]
            totals.seconds += stats.seconds
            totals.proposals += len(calls)
            totals.tokens += sum(len(result.tokens) for result in results if not isinstance(result, Exception))
            for i, result in zip(indices, results):
                if isinstance(result, Exception):  # the round verifies nothing drafted; the head's error is its own
                    result = Drafted([], None, 0)
                step = steps[i]
                drafted[step.seq_id] = (result, stats)
                if result.tokens:
                    tree = with_catch_up(len(step.new_ids), result.parents)
                    steps[i] = step._replace(new_ids=list(step.new_ids) + list(result.tokens),
                                             num_logits=step.num_logits + len(result.tokens), tree=tree)
                    self.sequences[step.seq_id].tokens += list(result.tokens)  # the next call says what stays
        return steps, drafted

    def verify(self, executor, steps: list[Step], ready: dict[int, tuple[Step, tuple[Drafted, ForwardStats]]] | None
               = None) -> tuple[list, dict[int, tuple[Drafted, ForwardStats]], float]:
        """A batch's steps on the target's `executor`: the hosted heads draft (`draft`), one forward verifies
        every step (extend_many with the features), their features are kept (`keep`). ready: by index, steps
        drafted already (a round run ahead, `ahead`: the step it ran and its proposal), not drafted again.
        Returns the forward's results (per step as extend_many's), the proposals by sequence, and the seconds
        the drafting took."""
        ready = ready or {}
        started = time.perf_counter()
        run, drafted = self.draft([step._replace(draft_head="") if i in ready else step
                                   for i, step in enumerate(steps)])
        seconds = time.perf_counter() - started
        for i, (step, proposal) in ready.items():
            run[i] = step
            drafted[step.seq_id] = proposal
        results = executor.extend_many(run, with_hidden=True)
        self.keep(run, results)
        return results, drafted, seconds

    def ahead(self, step: Step) -> tuple[Step, tuple[Drafted, ForwardStats], tuple] | None:
        """A round drafted before it is asked for (run_ahead.py): `step` as the next call is expected to ask
        for it (its keep and bonus token from this round's greedy picks, this round's K). Returns the step to
        run (the proposal appended), the proposal, and what `restore` needs where the call asks for another
        round; None where its head drafted nothing (or failed): nothing to run ahead of a plain verify."""
        hosted = self.sequences.get(step.seq_id)
        if hosted is None or hosted.head != step.draft_head:
            return None
        head = self.heads[hosted.head].sequences.get(step.seq_id)
        saved = (list(hosted.tokens), list(hosted.features.parts), hosted.features.end, hosted.pending,
                 head.entries if head is not None else 0)
        failures = self.failures
        run, drafted = self.draft([step])
        proposal = drafted.get(step.seq_id)
        if proposal is None or not proposal[0].tokens or self.failures > failures:
            self.restore(step.seq_id, saved)
            return None
        return run[0], proposal, saved

    def restore(self, seq_id: int, saved: tuple) -> None:
        """Undo `ahead`: the sequence's side as it was before (its head's entries past then are written again)."""
        hosted = self.sequences.get(seq_id)
        if hosted is None:
            return
        tokens, parts, end, pending, entries = saved
        hosted.tokens, hosted.pending = tokens, pending
        hosted.features.parts, hosted.features.end = parts, end
        head = self.heads[hosted.head].sequences.get(seq_id)
        if head is not None:
            head.entries = min(head.entries, entries)

    def _catch_up(self, step: Step) -> None:
        """The sequence brought to the call: what stays of the previous call's tokens and features."""
        hosted = self.sequences.get(step.seq_id)
        if hosted is None or hosted.head != step.draft_head:
            if hosted is not None:
                self.release(step.seq_id)
            hosted = self.sequences[step.seq_id] = _Hosted(step.draft_head)
        if hosted.pending is not None:
            start, count, tree, rows = hosted.pending
            if step.path is not None:  # the previous call was a tree: these of its new tokens stay
                kept = [hosted.tokens[start + node] for node in step.path]
                hosted.tokens[start:] = kept
                hosted.features.add(rows_on(rows, count, step.path), start + len(step.path), step.keep)
            else:
                hosted.features.add(rows, start + count, step.keep)
            hosted.pending = None
        del hosted.tokens[step.keep:]
        hosted.tokens += list(step.new_ids)

    def _head_step(self, head: HeadExecutor, step: Step) -> Step:
        """What the head is asked: its cached entries kept, the tokens after them, the features it lacks."""
        hosted = self.sequences[step.seq_id]
        seq = head.sequences.get(step.seq_id)
        keep = min(seq.entries if seq is not None else 0, len(hosted.tokens) - 1)
        return Step(step.seq_id, keep, hosted.tokens[keep:], k=step.k, params=step.params, generator=step.generator,
                    branches=step.branches, features=hosted.features.since(keep))

    def keep(self, steps: list[Step], results: list) -> None:
        """After the forward: each hosted sequence's new tokens and their features (the head's layers), which
        the next call cuts to what it keeps."""
        for step, result in zip(steps, results):
            hosted = self.sequences.get(step.seq_id) if step.draft_head else None
            if hosted is None:
                continue
            if not isinstance(result, Scored):  # the step failed: its sequence starts over
                self.release(step.seq_id)
                continue
            rows = result.hidden
            columns = self.columns[step.draft_head]
            rows = rows.flatten(1) if columns is None else rows.index_select(1, columns.to(rows.device)).flatten(1)
            hosted.pending = (step.keep, len(step.new_ids), step.tree, rows)

    def release(self, seq_id: int) -> None:
        hosted = self.sequences.pop(seq_id, None)
        if hosted is not None:
            self.heads[hosted.head].release(seq_id)

    def keep_only(self, live) -> None:
        """Forget the sequences the target no longer holds (evicted while idle)."""
        for seq_id in [seq_id for seq_id in self.sequences if seq_id not in live]:
            self.release(seq_id)
