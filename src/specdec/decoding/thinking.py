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
- `openai_gptoss`: gpt-oss's harmony messages (its analysis, commentary, calls) are thinking until the final
  channel's header, `<|channel|>final<|message|>`, as vLLM gates it; its answer is that message's body. This
  needs `<|channel|>` and `<|message|>` to be one token each (as in gpt-oss's vocabulary): where they are not,
  the model does not speak harmony and the grammar holds from the first token.

A thinking budget (`ThinkingBudget`, vLLM's thinking_token_budget) holds the thinking to at most that many
tokens: past it, the close tag's tokens are the only ones allowed (forced, as a grammar forces its text), with
or without a grammar after it. Harmony's close after a thinking under way is longer: the open message ends
and the final one starts, `<|end|><|start|>assistant<|channel|>final<|message|>` (the header alone when
nothing was thought).

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
    where an output stands at its first token (THINKING, or EITHER: it may open a block; ANSWER: no thinking).
    `closing`: what a budget forces after a thinking under way, ending in `close` (harmony's; () : `close`)."""

    open: tuple[int, ...]
    close: tuple[int, ...]
    start: str
    closing: tuple[int, ...] = ()

    @classmethod
    def of(cls, parser: str, encode) -> ThinkingTags:
        """`encode(text) -> token ids` without special tokens added. Raises ValueError for an unknown parser."""
        if parser not in tn.REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(tn.REASONING_PARSERS)})")
        if parser == tn.HARMONY_REASONING:
            return cls._harmony(encode)
        open_ids = tuple(int(t) for t in encode(tn.THINK_OPEN))
        close_ids = tuple(int(t) for t in encode(tn.THINK_CLOSE))
        if not close_ids:
            raise ValueError(f"the tokenizer spells {tn.THINK_CLOSE!r} with no token")
        if parser == "deepseek_r1":
            return cls(open_ids, close_ids, THINKING)
        return cls(open_ids, close_ids, EITHER if len(open_ids) == 1 else ANSWER)

    @classmethod
    def _harmony(cls, encode) -> ThinkingTags:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(int(t) for t in encode(text))

        header = ids(tn.HARMONY_CHANNEL + tn.HARMONY_FINAL + tn.HARMONY_MESSAGE)
        if len(ids(tn.HARMONY_CHANNEL)) != 1 or len(ids(tn.HARMONY_MESSAGE)) != 1:
            return cls((), header, ANSWER)  # no harmony vocabulary: no channels to wait for
        return cls((), header, THINKING, ids(tn.HARMONY_END + tn.HARMONY_START + tn.HARMONY_ROLE) + header)

    @property
    def forced(self) -> tuple[int, ...]:
        """What a budget forces after a thinking under way."""
        return self.closing or self.close


@dataclass(frozen=True)
class ThinkingBudget:
    """A request's thinking held to at most `budget` tokens (vLLM's thinking_token_budget): once it has thought
    that many, the close tag's tokens are the only ones allowed until the tag is complete (the end of a
    thinking under way counts as thinking). `answer`: the grammar that holds after the thinking (a compiled
    guide, grammar.Grammar; None: the answer is free). A rule as a grammar is (the decode loop's
    `GenerationRequest.grammar`): its masks are a function of the output so far, so speculative output stays
    target-only decoding under the same rule."""

    tags: ThinkingTags
    budget: int
    vocab_size: int  # the tokenizer's: a mask row's width where no grammar gives it
    answer: object | None = None

    def matcher(self) -> AnswerMatcher:
        return AnswerMatcher(self.answer.matcher() if self.answer is not None else None, self.tags, self.budget,
                             self.vocab_size)


class AnswerMatcher:
    """A grammar matcher (grammar.GrammarMatcher) applied after the thinking: the same interface, the inner
    matcher sees only the answer's tokens (`inner` None: the answer is free). With a `budget`, the thinking's
    tokens past it are the close tag's, forced (ThinkingBudget)."""

    def __init__(self, inner, tags: ThinkingTags, budget: int | None = None, vocab_size: int = 0):
        self._inner, self._tags, self._budget = inner, tags, budget
        self.vocab_size = inner.vocab_size if inner is not None else vocab_size
        self.words = (self.vocab_size + 31) // 32
        self._state = tags.start
        self._tail: tuple[int, ...] = ()  # the thinking's last tokens: a tag's beginning
        self._thought = 0  # tokens taken while thinking

    def _step(self, state: str, tail: tuple[int, ...], thought: int, token: int) -> tuple[str, tuple[int, ...], int]:
        """(state, tail, thought) after a token taken in `state` (not ANSWER: the grammar's then)."""
        if state == EITHER:
            return (THINKING, (), 0) if token == self._tags.open[0] else (ANSWER, (), 0)
        close = self._tags.close
        tail = (tail + (token,))[-len(self._tags.forced):]
        return (ANSWER, (), thought + 1) if tail[-len(close):] == close else (THINKING, tail, thought + 1)

    def _due(self, state: str, tail: tuple[int, ...], thought: int) -> list[int]:
        """The close tag's tokens the budget forces next (none while it lasts, or outside a thinking): those
        the tail has not begun already. Of the close and the longer closing (harmony's), the one the tail has
        begun further; neither begun: the closing after a thinking, the close when nothing was thought."""
        if state != THINKING or self._budget is None or thought < self._budget:
            return []
        options = []
        for tag in (self._tags.close, self._tags.forced):
            begun = next((k for k in range(len(tag) - 1, 0, -1) if tail[-k:] == tag[:k]), 0)
            options.append((begun, tag))
        (begun_close, close), (begun_forced, forced) = options
        if begun_close or begun_forced:
            begun, tag = max(options, key=lambda option: option[0])
        else:
            begun, tag = (0, close) if thought == 0 else (0, forced)
        return list(tag[begun:])

    def _walk(self, tokens: list[int]) -> tuple[int, int | None]:
        """Over `tokens` taken from here: (how many lead the thinking within its budget, where the answer
        starts among them; None: not within them, or a token the budget refuses comes first)."""
        state, tail, thought = self._state, self._tail, self._thought
        for i, token in enumerate(tokens):
            if state == ANSWER or (state == EITHER and token != self._tags.open[0]):
                return i, i  # (an EITHER token that is not the tag is the answer's first)
            due = self._due(state, tail, thought)
            if due and token != due[0]:
                return i, None
            state, tail, thought = self._step(state, tail, thought, token)
        return len(tokens), (len(tokens) if state == ANSWER else None)

    def forced(self, limit: int) -> list[int]:
        if self._state == ANSWER:
            return self._inner.forced(limit) if self._inner is not None else []
        return self._due(self._state, self._tail, self._thought)[:max(limit, 0)]

    def valid_prefix(self, tokens: list[int]) -> int:
        valid, start = self._walk(tokens)
        if start is None:
            return valid
        rest = tokens[start:]
        return start + (self._inner.valid_prefix(rest) if self._inner is not None else len(rest))

    def allowed(self, draft: list[int], positions: int) -> torch.Tensor:
        """(positions, words) int32 bitmask, as GrammarMatcher.allowed: all tokens at the positions that
        follow a thinking (the close tag's next token only, past the budget), the grammar's masks from the
        answer's first position; at an EITHER position the grammar's and `<think>`."""
        valid, start = self._walk(draft[:positions - 1])
        bits = torch.full((positions, self.words), -1, dtype=torch.int32)
        state, tail, thought = self._state, self._tail, self._thought
        for j in range(min(valid, positions - 1) + 1):  # the thinking's rows (none read after a refused token)
            if state == ANSWER or (start is not None and j >= start):
                break
            due = self._due(state, tail, thought)
            if due:
                bits[j] = 0
                word, value = _bit(due[0])
                bits[j, word] = value
            if j < valid:
                state, tail, thought = self._step(state, tail, thought, draft[j])
        if start is not None and start < positions and self._inner is not None:
            bits[start:] = self._inner.allowed(draft[start:], positions - start)
        if self._state == EITHER and self._inner is not None:
            if start != 0:  # the draft opened a block: its first position is still the grammar's or <think>
                bits[0] = self._inner.allowed([], 1)[0]
            word, value = _bit(self._tags.open[0])
            bits[0, word] |= value
        return bits

    def advance(self, tokens: list[int]) -> int | None:
        """GrammarMatcher.advance over the answer's tokens; the index is the round's."""
        for i, token in enumerate(tokens):
            if self._state == ANSWER or (self._state == EITHER and token != self._tags.open[0]):
                self._state, self._tail = ANSWER, ()
                if self._inner is None:
                    return None
                end = self._inner.advance(tokens[i:])
                return None if end is None else i + end
            self._state, self._tail, self._thought = self._step(self._state, self._tail, self._thought, token)
        return None


def _bit(token: int) -> tuple[int, int]:
    """Where a token's bit is in a bitmask row: its word, and the word's value with that bit alone (as int32)."""
    word, bit = divmod(token, 32)
    return word, (1 << bit) - (1 << 32 if bit == 31 else 0)
