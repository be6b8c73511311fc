"""Reading a request's input arrays: typed, shaped, and refused with an error that names the input."""

from __future__ import annotations

from typing import Callable

import numpy as np

InputLookup = Callable[[str], "np.ndarray | None"]  # input name -> its array, None when the request has none


class InputError(ValueError):
    """A bad request input; the message names the field."""


class Inputs:
    """Typed access to a request's inputs through a lookup."""

    def __init__(self, lookup: InputLookup):
        self.lookup = lookup

    def array(self, name: str, dtype) -> np.ndarray | None:
        value = self.lookup(name)
        if value is None:
            return None
        if value.dtype != dtype:
            raise InputError(f"input '{name}' must be {np.dtype(dtype).name}, got {value.dtype.name}")
        return value

    def scalar(self, name: str, dtype, default):
        value = self.array(name, dtype)
        if value is None:
            return default
        if value.size != 1:
            raise InputError(f"input '{name}' must hold exactly one value, got shape {list(value.shape)}")
        return value.reshape(-1)[0].item()

    def words(self, name: str, most: int) -> tuple[str, ...]:
        """A list of words; empty strings are dropped (TensorRT-LLM's clients send [""] for none)."""
        words = tuple(word for word in self.strings(name) if word)
        if len(words) > most:
            raise InputError(f"input '{name}' has {len(words)} entries; at most {most}")
        return words

    def strings(self, name: str) -> list[str]:
        value = self.array(name, np.object_)
        if value is None:
            return []
        out = []
        for item in value.reshape(-1):
            try:
                out.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
            except UnicodeDecodeError:
                raise InputError(f"input '{name}' is not valid UTF-8") from None
        return out
