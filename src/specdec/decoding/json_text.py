"""JSON text from outside (a client's request, a model's answer) read with one way to fail.

`json.loads` raises ValueError for text that is not JSON, but RecursionError for arrays or objects nested
past the interpreter's recursion limit (about a thousand levels): a reader that catches ValueError alone
lets that one escape, and a request answered 500, or never answered at all, is what follows. And `json.loads`
reads an escaped lone UTF-16 surrogate ("\\ud800") into a str that no encoder or tokenizer accepts later: it is
refused here, naming where it was."""

from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder()


def parse(text: str | bytes):
    """The value of `text`; ValueError (its message says why) for anything that is not JSON we can read,
    undecodable bytes, nesting too deep and strings that are not Unicode (a lone surrogate) included."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    escaped = _ESCAPED_SURROGATE_BYTES if isinstance(text, (bytes, bytearray)) else _ESCAPED_SURROGATE
    if escaped.search(text):  # (only an escape makes one: bytes decode as UTF-8, which has none)
        where = _lone_surrogate(value)
        if where is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate: not Unicode text")
    return value


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_ESCAPED_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and any("\ud800" <= c <= "\udfff" for c in text)


def _lone_surrogate(value) -> str | None:
    """Where a string (a value, or an object's key) holds a surrogate code point, named as the API names
    fields ("messages.0.content", "a key of tools.1"); None without one."""
    stack: list[tuple[object, tuple]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        where = ".".join(map(str, path)) or "the value"
        if isinstance(node, str) and _has_surrogate(node):
            return where
        if isinstance(node, dict):
            if any(_has_surrogate(key) for key in node):
                return f"a key of {where}"
            stack.extend((item, path + (key,)) for key, item in node.items())
        elif isinstance(node, list):
            stack.extend((item, path + (i,)) for i, item in enumerate(node))
    return None


def parse_at(text: str, at: int = 0) -> tuple[object, int]:
    """The JSON value that starts at text[at] and the index just past it (JSONDecoder.raw_decode), failing
    as `parse` does."""
    try:
        return _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError("nested too deeply") from None
