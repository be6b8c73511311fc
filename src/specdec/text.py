"""Tokenizer loading and incremental detokenization.

Streaming sends token ids round by round, and postprocessing turns each chunk into text given a few
preceding tokens as context. A chunk whose text would end inside a multi-byte character (an emoji or
CJK character split over byte-level tokens decodes to U+FFFD) is held back until the character is
complete, so concatenated stream deltas equal the non-streamed text exactly.
"""

from __future__ import annotations

from pathlib import Path

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6  # preceding tokens sent with a chunk: enough for byte-level and SentencePiece merges


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a model/tokenizer directory or a GGUF file."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer_path {path!r} does not exist")
    if p.is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def decode_delta(tokenizer, prefix_ids: list[int], ids: list[int]) -> str:
    """Text that `ids` add after `prefix_ids` (the context changes how a token's leading space decodes)."""
    if not prefix_ids:
        return decode(tokenizer, ids)
    before = decode(tokenizer, prefix_ids)
    after = decode(tokenizer, prefix_ids + ids)
    if after.startswith(before):
        return after[len(before):]
    return decode(tokenizer, ids)  # a normalizer rewrote the prefix: fall back to the chunk alone


class StreamChunker:
    """Decides which generated tokens can be streamed now: all but a trailing incomplete character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.emitted: list[int] = []  # tokens already sent
        self.pending: list[int] = []  # tokens held back

    def push(self, new_ids: list[int], final: bool) -> tuple[list[int], list[int]] | None:
        """Add a round's tokens; returns (chunk_ids, prefix_ids) to send now, or None to wait."""
        self.pending += new_ids
        if not self.pending:
            return None
        prefix = self.emitted[-CONTEXT_TOKENS:]
        if not final and decode_delta(self.tokenizer, prefix, self.pending).endswith(REPLACEMENT_CHAR):
            return None
        chunk, self.pending = self.pending, []
        self.emitted += chunk
        return chunk, prefix
