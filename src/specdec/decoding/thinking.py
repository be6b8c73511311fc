"""A reasoning model's thinking in token ids: structured output constrains only the answer after it.

Reasoning models (DeepSeek-R1, QwQ, Qwen3) write their thinking between `<think>` and `</think>`, then the
answer. A request that names its reasoning parser (the ensemble's `reasoning_parser`, which the OpenAI
gateway sends with `--reasoning-parser`) has its grammar applied after the thinking, as vLLM does, and as
the gateway's text split (gateway/reasoning.py) reads the same answer:

- `deepseek_r1`: the output thinks until `</think>` (the chat template may have opened the block); every token
  is allowed until the output's tokens end with the tag's, the grammar's masks from the next one on.
- `qwen3`: thinking only in a block the answer opens: the first position allows the grammar's tokens and
  `<think>`; taking it, the output thinks until `</think>`, else the grammar holds from the first token.
  This needs `<think>` to be one token (as in Qwen3's vocabulary): where it is not, the grammar holds from
  the first token (the model answers without thinking).

A tag is its tokens as the tokenizer spells it (one added token in those models' vocabularies); a model that
spells it otherwise stays in its thinking, unconstrained. The gate only moves where the grammar starts: each
position's mask is the grammar's after the answer so far, or all tokens while thinking, so speculative output
is exactly target-only decoding under the same rule (grammar.py). Pure: token ids in, masks out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import tensor_names as tn

THINKING, ANSWER, EITHER = "thinking", "answer", "either"  # where an output stands


@dataclass(frozen=True)
class ThinkingTags:
    """Where a parser's thinking starts and ends, in token ids: `open` / `close` are the tags' tokens, `start`
    where an output stands at its first token (THINKING, or EITHER: it may open a block)."""

    open: tuple[int, ...]
    close: tuple[int, ...]
    start: str

    @classmethod
    def of(cls, parser: str, encode) -> ThinkingTags:
        """`encode(text) -> token ids` without special tokens added. Raises ValueError for an unknown parser."""
        if parser not in tn.REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(tn.REASONING_PARSERS)})")
        open_ids = tuple(int(t) for t in encode(tn.THINK_OPEN))
        close_ids = tuple(int(t) for t in encode(tn.THINK_CLOSE))
        if not close_ids:
            raise ValueError(f"the tokenizer spells {tn.THINK_CLOSE!r} with no token")
        if parser == "deepseek_r1":
            return cls(open_ids, close_ids, THINKING)
        return cls(open_ids, close_ids, EITHER if len(open_ids) == 1 else ANSWER)


class AnswerMatcher:
    """A grammar matcher (grammar.GrammarMatcher) applied after the thinking: the same interface, the inner
    matcher sees only the answer's tokens."""

    def __init__(self, inner, tags: ThinkingTags):
        self._inner, self._tags = inner, tags
        self.vocab_size, self.words = inner.vocab_size, inner.words
        self._state = tags.start
        self._tail: tuple[int, ...] = ()  # the thinking's last tokens: a tag's beginning

    def _step(self, state: str, tail: tuple[int, ...], token: int) -> tuple[str, tuple[int, ...]]:
        """(state, tail) after a token taken in `state` (not ANSWER: the grammar's then)."""
        if state == EITHER:
            return (THINKING, ()) if token == self._tags.open[0] else (ANSWER, ())
        tail = (tail + (token,))[-len(self._tags.close):]
        return (ANSWER, ()) if tail == self._tags.close else (THINKING, tail)

    def _answer_from(self, tokens: list[int]) -> int | None:
        """Where the answer starts among `tokens` taken from here (None: not within them)."""
        state, tail = self._state, self._tail
        for i, token in enumerate(tokens):
            if state == ANSWER:
                return i
            if state == EITHER and token != self._tags.open[0]:
                return i  # not a block: this token is the answer's first
            state, tail = self._step(state, tail, token)
        return len(tokens) if state == ANSWER else None

    def forced(self, limit: int) -> list[int]:
        return self._inner.forced(limit) if self._state == ANSWER else []

    def valid_prefix(self, tokens: list[int]) -> int:
        start = self._answer_from(tokens)
        if start is None:
            return len(tokens)
        return start + self._inner.valid_prefix(tokens[start:])

    def allowed(self, draft: list[int], positions: int) -> torch.Tensor:
        """(positions, words) int32 bitmask, as GrammarMatcher.allowed: all tokens at the positions that
        follow a thinking, the grammar's masks from the answer's first position; at an EITHER position the
        grammar's and `<think>`."""
        start = self._answer_from(draft[:positions - 1])
        bits = torch.full((positions, self.words), -1, dtype=torch.int32)
        if start is not None and start < positions:
            bits[start:] = self._inner.allowed(draft[start:], positions - start)
        if self._state == EITHER:
            if start != 0:  # the draft opened a block: its first position is still the grammar's or <think>
                bits[0] = self._inner.allowed([], 1)[0]
            word, bit = divmod(self._tags.open[0], 32)
            bits[0, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # as int32
        return bits

    def advance(self, tokens: list[int]) -> int | None:
        """GrammarMatcher.advance over the answer's tokens; the index is the round's."""
        start = self._answer_from(tokens)
        if start is None:
            for token in tokens:
                self._state, self._tail = self._step(self._state, self._tail, token)
            return None
        for token in tokens[:start]:
            self._state, self._tail = self._step(self._state, self._tail, token)
        self._state, self._tail = ANSWER, ()
        end = self._inner.advance(tokens[start:])
        return None if end is None else start + end
