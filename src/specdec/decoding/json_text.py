"""JSON text from outside (a client's request, a model's answer) read with one way to fail.

`json.loads` raises ValueError for text that is not JSON, but RecursionError for arrays or objects nested
past the interpreter's recursion limit (about a thousand levels): a reader that catches ValueError alone
lets that one escape, and a request answered 500, or never answered at all, is what follows."""

from __future__ import annotations

import json

_DECODER = json.JSONDecoder()


def parse(text: str | bytes):
    """The value of `text`; ValueError (its message says why) for anything that is not JSON we can read,
    undecodable bytes and nesting too deep included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def parse_at(text: str, at: int = 0) -> tuple[object, int]:
    """The JSON value that starts at text[at] and the index just past it (JSONDecoder.raw_decode), failing
    as `parse` does."""
    try:
        return _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError("nested too deeply") from None
