"""A layer-skip self-draft (SWIFT): the target drafts for itself with some of its intermediate decoder
layers left out, its embedding, final norm and head shared; which layers are found on the fly.

  LayerSkipForward  a forward (transformers' `TransformersForward`, or the static executor's `StaticForward`:
                    on the CPU's C++ kernels, or with CUDA graphs for one set at a time) running a chosen
                    subset of the model's layers. Each sequence keeps the set it started with: its cache
                    holds those layers' keys and values only, so a new set applies to sequences that start
                    after it is chosen. A batch of sequences with different sets runs one forward per set;
                    with CUDA graphs the search's chosen set replays them (`hold_graphs`), older sets run
                    eagerly until their sequences end.
  agreement         how often a set's greedy token equals the whole model's over a text (one forward each)
  SkipTuner         the search (`decoding.skip_search.SkipSearch`) fed with the live sequences' text

In the separate draft_model process the draft holds a copy of the whole target (any set may be chosen):
the target's weights once more, and KV buffers for every layer per sequence (skipped ones stay unwritten).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from specdec.decoding.skip_search import SkipSearch, relative_cost
from specdec.engine.interfaces import ForwardOutput


def parse_layers(text: str, layers: int) -> tuple[int, ...]:
    """"3,5,7-9" -> (3, 5, 7, 8, 9): the intermediate layers (1 .. layers - 2) to skip (ValueError naming
    what is wrong)."""
    skip: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{part!r} is not a layer or a range of layers (like 7-9)") from None
        skip.update(range(low, high + 1))
    return check_skip(tuple(sorted(skip)), layers)


def check_skip(skip: tuple[int, ...], layers: int) -> tuple[int, ...]:
    wrong = [layer for layer in skip if not 0 < layer < layers - 1]
    if wrong:
        raise ValueError(f"layers {wrong} cannot be skipped: only intermediate layers, 1 .. {layers - 2} of this "
                         f"model's {layers}")
    return tuple(sorted(set(skip)))


@contextlib.contextmanager
def running(model, skip: tuple[int, ...]):
    """The model's forward runs without the layers in `skip` while inside (each kept layer keeps its
    layer_idx: its own KV buffers)."""
    body = model.model
    every = body.layers
    if skip:
        body.layers = torch.nn.ModuleList([layer for i, layer in enumerate(every) if i not in set(skip)])
    try:
        yield
    finally:
        body.layers = every


class LayerSkipForward:
    """`inner` (a TransformersForward over `model`, or an eager StaticForward: its `skipping`) with a subset
    of the model's layers per sequence."""

    hidden_layers = ()

    def __init__(self, inner, model, skip: tuple[int, ...] = ()):
        self.inner, self.model = inner, model
        self.layers = len(model.model.layers)
        self.max_tree_rows = inner.max_tree_rows
        self.skip = check_skip(tuple(skip), self.layers)

    def set_skip(self, skip: tuple[int, ...]) -> None:
        """Sequences that start from now on skip these layers."""
        self.skip = check_skip(tuple(skip), self.layers)

    @property
    def graph_skip(self) -> tuple[int, ...] | None:
        """The set the inner forward's CUDA graphs run (None: it captures none)."""
        return getattr(self.inner, "graph_skip", None) if getattr(self.inner, "mode", "off") == "graphs" else None

    def hold_graphs(self, skip: tuple[int, ...]) -> None:
        """The inner forward's CUDA graphs run this set from now on (StaticForward.retarget), if it has any."""
        if self.graph_skip is not None:
            self.inner.retarget(check_skip(tuple(skip), self.layers))

    def set_of(self, seq) -> tuple[int, ...]:
        # A sequence's first forward fixes its set (kept in its state: it goes with the sequence).
        if getattr(seq, "skip", None) is None:
            seq.skip = self.skip
        return seq.skip

    def warm_up(self, time_budget_s: float = 0.0) -> tuple[int, float]:
        return self.inner.warm_up(time_budget_s)

    def summary(self, ready: int, seconds: float) -> str:
        return (f"layer-skip self-draft over {self.layers} layers, now skipping {list(self.skip)}; "
                + self.inner.summary(ready, seconds))

    def __call__(self, seqs: list, rows: list, num_logits: list[int], trees: list | None = None) -> ForwardOutput:
        groups: dict[tuple[int, ...], list[int]] = {}
        for b, seq in enumerate(seqs):
            groups.setdefault(self.set_of(seq), []).append(b)
        trees = trees or [None] * len(seqs)
        logits: list = [None] * len(seqs)
        skipping = getattr(self.inner, "skipping", None) or (lambda skip: running(self.model, skip))
        for skip, members in groups.items():
            with skipping(skip):
                out = self.inner([seqs[b] for b in members], [rows[b] for b in members],
                                 [num_logits[b] for b in members], [trees[b] for b in members])
            for b, row in zip(members, out.logits):
                logits[b] = row
        return ForwardOutput(logits, None)


@torch.inference_mode()
def greedy_tokens(model, ids: list[int], skip: tuple[int, ...] = ()) -> torch.Tensor:
    """The greedy next token at every position of `ids` (a plain forward, no cache): (len(ids),) int64."""
    tokens = torch.tensor([ids], device=model.device)
    with running(model, skip):
        return model(input_ids=tokens).logits[0].argmax(-1)


def agreement(model, ids: list[int], skip: tuple[int, ...], whole: torch.Tensor | None = None) -> float:
    """How often the set's greedy token equals the whole model's over `ids` (`whole`: the whole model's
    greedy_tokens, when known)."""
    whole = greedy_tokens(model, ids) if whole is None else whole
    return float((greedy_tokens(model, ids, skip) == whole).float().mean())


def _products(module) -> int:
    """Multiply-adds per token of a module's linear layers (plain or oneDNN's prepacked ones)."""
    return sum(m.in_features * m.out_features for m in module.modules()
               if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int))


def head_cost_in_layers(model) -> float:
    """What a step costs besides the decoder layers (the head's product), in layers: by multiply-adds."""
    head = model.get_output_embeddings()
    return _products(head) / _products(model.model.layers[0]) if head is not None else 0.0


def verify_costs(executor, forward: LayerSkipForward, positions: int, sequence: int, context: int = 64,
                 repeats: int = 2) -> tuple[float, ...]:
    """[v(1) .. v(positions - 1)]: the whole model's forward of k + 1 rows over its forward of one (the
    quietest of `repeats` each), after `context` tokens, on the scratch sequence `sequence` (released
    after): what a verify costs in target steps, measured on the draft's copy of the target."""
    every = forward.skip
    forward.set_skip(())  # the scratch sequence runs every layer, as the target's verify does
    try:
        executor.extend(sequence, 0, [1] * context, 1)

        def quietest(rows: int) -> float:
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                out = executor.extend(sequence, context, [1] * rows, rows)  # keep=context: the rows again
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
                best = min(best, time.perf_counter() - started)
            return best

        one = quietest(1)
        return tuple(quietest(rows) / one for rows in range(2, positions + 1))
    finally:
        executor.release(sequence)
        forward.set_skip(every)


class SkipTuner:
    """The search over the traffic: `trial` measures one candidate set on a live sequence's text (its last
    `context` tokens) and makes the best set the forward's for new sequences. `due` paces trials: one per
    call while the first `warm_trials` run, then one per `interval_s`. scratch_sequence: a sequence id no
    request uses; where given, the first trial measures what a verify of up to 9 positions costs
    (`verify_costs`) and the search scores sets with it (beyond, along the line through the last two)."""

    MEASURED_K = 8  # verify costs measured up to this many drafted tokens (a forward each, twice)

    def __init__(self, executor, forward: LayerSkipForward, k_max: int = 8, seed: int = 0,
                 context: int = 64, min_context: int = 32, trials_per_text: int = 8, warm_trials: int = 48,
                 interval_s: float = 10.0, log: Callable[[str], None] = lambda message: None,
                 clock: Callable[[], float] = time.monotonic, scratch_sequence: int | None = None):
        self.executor, self.forward, self.log, self.clock = executor, forward, log, clock
        self.scratch_sequence = scratch_sequence
        model = executor.model
        self.search = SkipSearch(forward.layers, head_cost_in_layers(model), k_max, seed, best=forward.skip)
        self.context, self.min_context, self.trials_per_text = context, min_context, trials_per_text
        self.warm_trials, self.interval_s = warm_trials, interval_s
        self._text: list[int] | None = None
        self._whole: torch.Tensor | None = None
        self._on_text = 0
        self._last = float("-inf")
        self.last_alpha = 0.0
        executor.keep_tokens = True

    @property
    def cost(self) -> float:
        """The chosen set's draft step over a whole step (its relative cost)."""
        s = self.search
        return relative_cost(s.layers - len(s.best), s.layers, s.fixed)

    @property
    def warming(self) -> bool:
        """The first `warm_trials` are not done yet."""
        return self.search.trials < self.warm_trials

    def due(self) -> bool:
        return self.warming or self.clock() - self._last >= self.interval_s

    def _pick_text(self) -> list[int] | None:
        """The last `context` tokens of the live sequence with the most known tokens (None: none has
        min_context)."""
        best = None
        for seq in self.executor.sequences.values():
            tokens = seq.tokens[:seq.length]
            if len(tokens) >= self.min_context and -1 not in tokens[-self.context:] and \
                    (best is None or len(tokens) > len(best)):
                best = tokens
        return None if best is None else list(best[-self.context:])

    def _measure_verify(self) -> None:
        """The search's verify costs, once (`verify_costs`, up to MEASURED_K drafted tokens, along the line
        through the last two beyond); where they cannot be measured (no KV room now, say) the search goes
        on pricing a verify at one target step."""
        try:
            measured = verify_costs(self.executor, self.forward, min(self.search.k_max, self.MEASURED_K) + 1,
                                    self.scratch_sequence)
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not stop the search
            self.scratch_sequence = None
            self.log(f"layer-skip draft: the verify's cost could not be measured ({type(exc).__name__}: {exc}); "
                     "the search prices a verify at one target step")
            return
        slope = max(0.0, measured[-1] - measured[-2]) if len(measured) > 1 else 0.0  # a verify's rows never free
        self.search.verify = measured + tuple(measured[-1] + slope * (k - len(measured))
                                              for k in range(len(measured) + 1, self.search.k_max + 1))
        self.log("layer-skip draft: a verify of " + ", ".join(
            f"{k + 1} positions {self.search.verify[k - 1]:.2f}" for k in (1, 2, 4) if k <= len(measured))
            + " target steps (measured on the draft's copy of the target; the search scores sets with them)")

    def trial(self) -> bool:
        """Measure one candidate if a text is at hand; True if the forward's set changed."""
        if self.scratch_sequence is not None and not self.search.verify:
            self._measure_verify()
        if self._text is None or self._on_text >= self.trials_per_text:
            text = self._pick_text()
            if text is None and self._text is None:
                return False
            if text is None or text == self._text:  # no new text (the draft paused, or idle): the last again
                self._on_text = 0
            else:
                self._text, self._whole, self._on_text = text, greedy_tokens(self.executor.model, text), 0
                self.search.text_changed()
        skip = self.search.candidate()
        alpha = agreement(self.executor.model, self._text, skip, self._whole)
        incumbent = skip == self.search.best
        improved = self.search.report(skip, alpha)
        if incumbent:
            self.last_alpha = alpha
        self._on_text += 1
        self._last = self.clock()
        if improved:
            self.last_alpha = alpha
            self.forward.set_skip(self.search.best)
            self.forward.hold_graphs(self.search.best)  # new sequences replay graphs of it (on CUDA)
            self.log(f"layer-skip draft: skipping layers {list(self.search.best)} ({len(self.search.best)} of "
                     f"{self.search.layers}): agreement {alpha:.2f}, draft step {self.cost:.2f} of a target step, "
                     f"estimated speedup {self.search.best_score:.2f}x (trial {self.search.trials})")
        return improved
