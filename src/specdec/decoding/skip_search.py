"""Which of the target's layers a layer-skip self-draft leaves out, searched on the fly (SWIFT's idea: no
training, no labels, the model and the traffic at hand).

A candidate is a set of intermediate layers to skip (never the first or the last). Its worth is the speedup
a chain of its drafts would bring, estimated from two numbers: its agreement α (how often its greedy token
equals the whole model's on the same text: the acceptance of a greedy draft) and its cost c (one of its
draft steps over one target step, from the layers it runs). Score = max over k <= k_max of
E(α, k) / (k·c + v(k)), with E(α, k) = (1 - α^(k+1)) / (1 - α) the tokens a round yields and v(k) a verify
of k + 1 positions over a target step: measured where given (`verify`; on a CPU a 5-row verify costs about
two steps, and taken as one the score promised 0.93x where the rounds gave 0.7-0.85x), else 1.

The search is random, then local: `random_trials` random sets (a size drawn from 1 .. half the middle
layers, then that many of them), then mutations of the best set (skip one more, one fewer, or
swap a skipped layer for a kept one). Scores from different texts are not comparable, so whenever the text
changes the caller re-scores the incumbent first (`incumbent_stale`). Deterministic under a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.decoding.draft_length import expected_tokens


def estimated_speedup(alpha: float, cost: float, k_max: int, verify: Sequence[float] = ()) -> float:
    """max over 1 <= k <= k_max of E(alpha, k) / (k * cost + v(k)): a chain draft's speedup over target-only
    (alpha: per-token acceptance, cost: a draft step over a target step; verify: [v(1), v(2), ...], a verify
    of k + 1 positions over a target step, 1 past its end: a verify about as dear as a step)."""
    return max(expected_tokens(alpha, k) / (k * cost + (verify[k - 1] if k <= len(verify) else 1.0))
               for k in range(1, k_max + 1))


def relative_cost(kept: int, layers: int, fixed: float) -> float:
    """A draft step running `kept` of `layers` decoder layers, over a whole step; `fixed` is what every
    step costs besides the layers (the head), in layers."""
    return (fixed + kept) / (fixed + layers)


@dataclass
class SkipSearch:
    """The search's state: propose a set (`candidate`), then `report` its agreement on the current text.

    layers: the model's decoder layers; fixed: the head's cost in layers (relative_cost); k_max: the
    longest chain a round drafts; verify: [v(1), v(2), ...] where measured (estimated_speedup)."""

    layers: int
    fixed: float = 0.0
    k_max: int = 8
    seed: int = 0
    random_trials: int = 16
    verify: tuple[float, ...] = ()
    best: tuple[int, ...] = ()
    best_score: float = 0.0
    trials: int = 0
    incumbent_stale: bool = True  # the best's score is from another text (or it has none)
    tried: dict[tuple[int, ...], float] = field(default_factory=dict)  # set -> its last score

    def __post_init__(self):
        if self.layers < 3:
            raise ValueError(f"a layer-skip draft needs at least 3 decoder layers, got {self.layers}")
        self.rng = random.Random(self.seed)
        self.middle = list(range(1, self.layers - 1))

    def score(self, skip: tuple[int, ...], alpha: float) -> float:
        cost = relative_cost(self.layers - len(skip), self.layers, self.fixed)
        return estimated_speedup(alpha, cost, self.k_max, self.verify)

    def candidate(self) -> tuple[int, ...]:
        """The next set to measure: the incumbent where its score is stale, else a new set."""
        if self.incumbent_stale:
            return self.best
        for _ in range(32):  # a set not tried yet, where one is found (never the empty set)
            skip = self._random() if self.trials < self.random_trials else self._mutation()
            if skip not in self.tried:
                return skip
        return skip

    def _random(self) -> tuple[int, ...]:
        # As many sets of each size up to half the middle layers: on a small model even a few skipped
        # layers cost much of the agreement, on a large one many may go.
        count = self.rng.randint(1, max(1, len(self.middle) // 2))
        return tuple(sorted(self.rng.sample(self.middle, count)))

    def _mutation(self) -> tuple[int, ...]:
        skipped = set(self.best)
        kept = [layer for layer in self.middle if layer not in skipped]
        # A set skips at least one layer: skipping none is the target drafting for itself at its full cost
        moves = [move for move, possible in (("add", kept), ("drop", len(skipped) > 1), ("swap", kept and skipped))
                 if possible]
        move = self.rng.choice(moves)
        if move in ("add", "swap"):
            skipped.add(self.rng.choice(kept))
        if move in ("drop", "swap"):
            skipped.discard(self.rng.choice(sorted(set(self.best))))
        return tuple(sorted(skipped))

    def report(self, skip: tuple[int, ...], alpha: float) -> bool:
        """Record a set's agreement on the current text; True if it is the new best (an empty incumbent,
        a set given to start from, is replaced by the first set measured)."""
        score = self.score(skip, alpha) if skip else 0.0
        self.tried[skip] = score
        if skip == self.best and self.incumbent_stale:  # the incumbent, re-scored on this text
            self.best_score, self.incumbent_stale = score, False
            return False
        self.trials += 1
        if score > self.best_score:
            self.best, self.best_score = skip, score
            return True
        return False

    def text_changed(self) -> None:
        """The next reports measure another text: the incumbent is scored again first."""
        self.incumbent_stale = True
