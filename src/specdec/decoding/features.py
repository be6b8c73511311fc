"""What a trained head reads of the target between rounds: the target's features at the positions the head
has not read, kept as verifies return them and cut to what each round keeps (a chain's accepted prefix, a
tree's accepted path). The decode loop keeps them for a head it calls (decoding/loop.py); a head in the
target's process keeps them there (engine/hosted_heads.py)."""

from __future__ import annotations

import torch


class Features:
    """The target's features (Scores.features) the head has not read yet: rows for the positions
    [end - held, end), end being the target's valid prefix. Kept as the verifies' parts and joined when the
    head reads them: while a head is paused every round adds a row, and joining each time copied all the
    rows held (a long prompt's, megabytes) every round."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.end = 0

    def add(self, new: torch.Tensor | None, new_end: int, valid: int) -> None:
        """A verify's rows, for the positions up to new_end, of which those below `valid` stay (accepted)."""
        if new is None:
            return
        new = new[:len(new) - (new_end - valid)] if new_end > valid else new
        first = valid - len(new)
        if not self.parts or self.end != first:  # a gap: the older rows are no use
            self.parts = []
        self.parts.append(new.to(self.parts[0].device) if self.parts else new)
        self.end = valid

    def since(self, start: int) -> torch.Tensor | None:
        """The rows of positions start.. end - 1 that are held (the last ones where some are missing)."""
        if not self.parts:
            return None
        wanted, picked, count = self.end - start, [], 0
        for part in reversed(self.parts):  # the parts that hold them (the older ones are read)
            if count >= wanted and picked:
                break
            picked.append(part)
            count += len(part)
        rows = picked[0] if len(picked) == 1 else torch.cat(picked[::-1])
        self.parts = [rows[max(len(rows) - wanted, 0):]]
        return self.parts[0]


def rows_on(rows: torch.Tensor | None, count: int, path: tuple[int, ...]) -> torch.Tensor | None:
    """A tree verify's feature rows (the last len(rows) of its `count` new tokens, in node order) along the
    kept `path` (indices into the new tokens, increasing): the rows of the positions the target keeps."""
    if rows is None:
        return None
    first = count - len(rows)
    return rows[[i - first for i in path if i >= first]]


def with_catch_up(catch_up: int, parents: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """A tree proposal's parents over the whole verify's new_ids: the `catch_up` tokens the target's cache
    lacks come first, a chain, and the tree's roots hang from the last of them. None for a chain."""
    if not parents:  # a chain, or nothing proposed
        return None
    return tuple(range(-1, catch_up - 1)) + tuple(catch_up - 1 if p < 0 else catch_up + p for p in parents)
