"""Repetition, presence and frequency penalties on the target's logits (vLLM's and OpenAI's rules, the
names TensorRT-LLM's and vLLM's clients send).

At a position whose preceding tokens are prompt + generated, a token's logit l becomes
    l / r  (l > 0)  or  l * r  (l <= 0)         if the token occurs in prompt + generated  (repetition r)
    then  - f * count - p * [count > 0]           count: its occurrences in generated  (frequency f, presence p)
before temperature, top-k, top-p and min-p (and before the greedy argmax). The repetition rule is transformers'
`repetition_penalty`; presence and frequency count generated tokens only, as vLLM and OpenAI do.

Speculation stays exact: verify position j penalises with the round's drafts x_1..x_j as generated
tokens, exactly what target-only decoding would have generated before it had it accepted them. The draft
needs no penalties for the accept/reject rule to stay exact (it would only be accepted more often).

Only the columns of tokens that occur change, so the work is over those (a few thousand at most), not
the vocabulary: `TokenOccurrences` keeps a request's distinct tokens and output counts as tokens are
accepted, and `penalize` edits those columns of a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec import tensor_names as tn


@dataclass(frozen=True)
class Penalties:
    repetition: float = tn.DEFAULT_REPETITION_PENALTY  # r > 0; 1 = off
    presence: float = tn.DEFAULT_PRESENCE_PENALTY  # p; 0 = off
    frequency: float = tn.DEFAULT_FREQUENCY_PENALTY  # f; 0 = off

    @property
    def active(self) -> bool:
        return (self.repetition != tn.DEFAULT_REPETITION_PENALTY or self.presence != tn.DEFAULT_PRESENCE_PENALTY
                or self.frequency != tn.DEFAULT_FREQUENCY_PENALTY)


class TokenOccurrences:
    """A request's distinct tokens (prompt and output) and how often each occurs in the output, grown as
    tokens are accepted: a round costs work in its new tokens and drafts, not in the context's length."""

    def __init__(self, prompt: Sequence[int]):
        self._column = {token: i for i, token in enumerate(dict.fromkeys(prompt))}
        self.ids = torch.tensor(list(self._column), dtype=torch.long)  # [S] distinct tokens, first seen first
        self.counts = torch.zeros(len(self._column))  # [S] float32: occurrences of ids[i] in the output

    def add_output(self, tokens: Sequence[int]) -> None:
        new = [token for token in dict.fromkeys(tokens) if token not in self._column]
        if new:
            self._column.update({token: len(self._column) + i for i, token in enumerate(new)})
            self.ids = torch.cat([self.ids, torch.tensor(new, dtype=torch.long)])
            self.counts = torch.cat([self.counts, torch.zeros(len(new))])
        self.counts.index_add_(0, torch.tensor([self._column[token] for token in tokens], dtype=torch.long),
                               torch.ones(len(tokens)))

    def rows(self, draft: Sequence[int], positions: int, width: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the `positions` positions of a verify see, position j after the drafts draft[:j]:
        (columns [S] int64 token ids, counts [P, S] float32 output occurrences, present [P, S] bool: in
        prompt + output + draft[:j]). S: the distinct tokens plus the drafts not among them yet, less any
        id >= width (a vocabulary of `width` logits has no column for it)."""
        seen = len(self._column)
        extra: dict[int, int] = {}
        increments = []  # (row, column): draft[i] counts from row i + 1 on
        for i, token in enumerate(draft[:max(positions - 1, 0)]):
            column = self._column.get(token)
            if column is None:
                column = extra.setdefault(token, seen + len(extra))
            increments += [(row, column) for row in range(i + 1, positions)]
        columns = torch.cat([self.ids, torch.tensor(list(extra), dtype=torch.long)]) if extra else self.ids
        counts = torch.cat([self.counts, torch.zeros(len(extra))]).repeat(positions, 1)
        if increments:
            rows, cols = zip(*increments)
            counts.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.ones(len(increments)), accumulate=True)
        present = torch.ones(positions, len(columns), dtype=torch.bool)
        present[:, seen:] = counts[:, seen:] > 0  # a draft token only after it is drafted
        if len(columns) and int(columns.max()) >= width:  # on the host: a mask on the device would sync it
            keep = columns < width
            columns, counts, present = columns[keep], counts[:, keep], present[:, keep]
        return columns.to(device), counts.to(device), present.to(device)


def penalize(logits: torch.Tensor, columns: torch.Tensor, counts: torch.Tensor, present: torch.Tensor,
             penalties: Penalties) -> torch.Tensor:
    """logits [P, V] penalised in the given columns (a new tensor; half precisions computed in float32).

    columns [S] int64 distinct token ids < V; counts [P, S] their occurrences in each position's output;
    present [P, S] whether each occurs in the position's prompt + output (`TokenOccurrences.rows`)."""
    out = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
    counts = counts.to(out.dtype)
    values = out[:, columns]
    if penalties.repetition != tn.DEFAULT_REPETITION_PENALTY:
        repeated = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
        values = torch.where(present, repeated, values)
    if penalties.frequency != tn.DEFAULT_FREQUENCY_PENALTY:
        values = values - penalties.frequency * counts
    if penalties.presence != tn.DEFAULT_PRESENCE_PENALTY:
        values = values - penalties.presence * (counts > 0).to(out.dtype)
    out[:, columns] = values
    return out
