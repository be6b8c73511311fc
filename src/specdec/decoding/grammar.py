"""Structured output: the target's distribution restricted to what a grammar allows, exact under speculation.

A request's guide (a JSON schema, any JSON object, a regex, a GBNF or Lark grammar, a list of choices, or
structural tags: free text in which a trigger string opens a tagged JSON segment, as tool calls are written)
compiles once to an llguidance grammar over the target's tokenizer; a matcher follows the request's output
token by token. The allowed tokens at a verify position depend on the drafts before it, as bans do:
position j of a round gets the matcher's mask after the output so far plus the drafts x_1..x_j, and every
other token's logit becomes -inf before anything reads the logits (the greedy argmax, or sampling's
processing and the accept/reject test). Speculative output is then exactly target-only decoding under the
same constraint: a drafted token the grammar refuses is never the target's greedy choice and has target
probability 0 when sampling (always rejected; after it no position is read).

Drafts: where the grammar forces the next text (a JSON schema's next key, its quotes and colon), that
text's tokens are the round's proposal, with no draft forward: a deterministic proposal, as prompt lookup's,
so the output is unchanged and the target accepts them unless it prefers another tokenization. Otherwise a
greedy request's proposal, or a deterministic one (prompt lookup), is cut before its first token
the grammar refuses. The target would reject that token with certainty and then emit the same token
(greedy) or sample from p_t itself (a one-hot draft's residual is p_t where p_t(x) = 0), so the cut changes
no output and saves verify positions. A sampled draft model's proposal stays whole: whether it would be
cut depends on the draw, and cutting it would replace the residual by p_t in that event, which changes
the output distribution.

The end: once the grammar is complete (nothing may follow but the end of sequence), or the output takes
the grammar's end-of-sequence token where the grammar may end, generation ends with finish_reason "stop";
that token is not part of the output.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch

from specdec import tensor_names as tn
from specdec.decoding import json_text
from specdec.decoding.structural_tags import (MAX_CHOICES, StructuralTagError, refuse_unrollable,
                                              structural_tag_grammar)
from specdec.decoding.thinking import AnswerMatcher, ThinkingTags

MAX_ERROR_CHARS = 300  # llguidance's messages can quote the whole grammar; a client gets the start


class GuideError(ValueError):
    """A guide that does not compile (its message says why; the caller names the field)."""


# Compiled guides kept per compiler: clients send the same schema again and again. Bounded, because a large
# schema's grammar and matcher hold over a megabyte.
CACHED_GUIDES = 64
SEEN_GUIDES = 4096  # guides remembered (by hash) as compiled once: the second time, one is kept


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled guide: llguidance's grammar definition over a tokenizer, and a matcher at its start with
    its first forced text and mask computed. A request's matcher is a copy of it: building a matcher parses
    the grammar again, milliseconds for a large schema, a copy does not."""

    tokenizer: llguidance.LLTokenizer
    definition: str
    start: llguidance.LLMatcher
    after: ThinkingTags | None = None  # applied after a reasoning model's thinking (thinking.py), else at once

    def matcher(self) -> Matcher:
        inner = GrammarMatcher(self)
        return inner if self.after is None else AnswerMatcher(inner, self.after)

    def after_thinking(self, tags: ThinkingTags) -> Grammar:
        """The same grammar applied to the answer after the thinking (the compiled guide shared)."""
        return dataclasses.replace(self, after=tags)


class GuideCompiler:
    """Compiles guides for one tokenizer (converting a Hugging Face tokenizer takes ~0.3 s: once per model
    instance, at load) and keeps the CACHED_GUIDES used last, so a guide sent again costs a lookup and a
    matcher copy instead of milliseconds of compiling. Thread-safe."""

    def __init__(self, hf_tokenizer, cached: int = CACHED_GUIDES):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        # special tokens by their text: written in a structural tag, each is matched as the token (a model writes
        # it as one), not as its text
        self._special = {added.content: int(token) for token, added in
                         getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if added.special}
        self._special.update({text: hf_tokenizer.convert_tokens_to_ids(text) for text in hf_tokenizer.all_special_tokens
                              if text not in self._special})
        self._cached, self._cache = cached, OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of guides compiled once and not kept
        self._lock = threading.Lock()  # large guides compile on a thread, small ones on the event loop

    def compile(self, guide_type: str, guide: str) -> Grammar:
        """guide_type: one of tn.GUIDE_TYPES; guide: its text (ignored for "json"). Raises GuideError."""
        key = (guide_type, guide)
        with self._lock:
            grammar = self._cache.pop(key, None)
        if grammar is None:
            grammar = self._compile(guide_type, guide)  # a failure raises: nothing is kept
            # Kept from its second time on: compiling gets slower while matchers are held (measured), so a
            # stream of guides that each come once is compiled as if nothing were kept.
            with self._lock:
                if _first_time(self._seen, hash(key), SEEN_GUIDES):
                    return grammar
        with self._lock:
            self._cache[key] = grammar  # the most recently used last
            while len(self._cache) > self._cached:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, guide_type: str, guide: str) -> Grammar:
        if guide_type not in tn.GUIDE_TYPES:
            raise GuideError(f"unknown guide type {guide_type!r} (one of {', '.join(tn.GUIDE_TYPES)})")
        if guide_type != "json" and not guide:  # (a lone space is a valid regex)
            raise GuideError(f"a {guide_type} guide is empty")
        try:
            if guide_type == "choice":
                choices = json_text.parse(guide)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                    raise GuideError("a choice guide must be a JSON list of non-empty strings")
                if len(choices) > MAX_CHOICES:
                    raise GuideError(f"a choice guide may list at most {MAX_CHOICES} choices, got {len(choices)}")
                definition = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(choice) for choice in choices))
            elif guide_type == "json":
                definition = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            elif guide_type == "structural_tag":
                definition = structural_tag_grammar(guide, self._special, frozenset(self.tokenizer.eos_tokens),
                                                    self.tokenizer.vocab_size)
            else:
                definition = llguidance.grammar_from(
                    {"json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "grammar"}[guide_type], guide)
                if guide_type == "ebnf_grammar":
                    refuse_unrollable(definition, "the grammar")
        except GuideError:
            raise
        except StructuralTagError as exc:
            raise GuideError(str(exc)) from None
        except ValueError as exc:  # not JSON, or a grammar not converting
            raise GuideError(_short(str(exc))) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, self.tokenizer)
        if failed:
            raise GuideError(_short(messages[0]))
        start = llguidance.LLMatcher(self.tokenizer, definition, log_level=0)
        if start.is_error():
            raise GuideError(_short(start.get_error()))
        start.compute_ff_bytes()  # the first forced text and mask: computed once, copied with the matcher
        start.compute_bitmask()
        if start.is_error():
            raise GuideError(_short(start.get_error()))
        return Grammar(self.tokenizer, definition, start)


def _first_time(seen: OrderedDict, key: int, limit: int) -> bool:
    """Whether `key` is new to `seen`: then it is remembered (the oldest forgotten past `limit`), else forgotten."""
    if key in seen:
        del seen[key]
        return False
    seen[key] = None
    while len(seen) > limit:
        seen.popitem(last=False)
    return True


class GrammarMatcher:
    """One request's place in its grammar: it has consumed the request's output so far."""

    def __init__(self, grammar: Grammar):
        self._matcher = grammar.start.deep_copy()
        self._tokenizer = grammar.tokenizer
        self.vocab_size = grammar.tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32  # 32-bit words of a bitmask row

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens spelling the text the grammar forces next (a schema's next key and its
        punctuation), tokenized as the tokenizer would: a deterministic proposal that costs no draft forward.
        The target still verifies it (it may prefer another tokenization of the same text)."""
        text = self._matcher.compute_ff_bytes() if limit > 0 else b""
        if not text:
            return []
        tokens = self._tokenizer.tokenize_bytes(text)[:limit]
        return tokens[:self.valid_prefix(tokens)]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here (no state change)."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def allowed(self, draft: list[int], positions: int) -> torch.Tensor:
        """(positions, words) int32 bitmask of the tokens allowed at each verify position: bit i of word w is
        token 32 w + i; position j follows the output so far plus draft[:j]. Rows after the first draft token
        the grammar refuses allow everything (the verdict never reads them). Tokens past the tokenizer's
        vocabulary are never allowed in the others. llguidance writes each row in place."""
        valid = self.valid_prefix(draft[:positions - 1])
        bits = torch.full((positions, self.words), -1, dtype=torch.int32)
        for j in range(valid + 1):
            self._matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), self.words * 4)
            if j < valid and not self._matcher.consume_token(draft[j]):
                raise RuntimeError(f"grammar matcher: {_short(self._matcher.get_error())}")
        if valid and not self._matcher.rollback(valid):
            raise RuntimeError(f"grammar matcher: {_short(self._matcher.get_error())}")
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher: {_short(self._matcher.get_error())}")
        return bits

    def advance(self, tokens: list[int]) -> int | None:
        """Consume a round's tokens (each one allowed where it stands). Returns where the output ends when the
        grammar ended among them (the index of its end-of-sequence token, dropped, or one past the token that
        completed the grammar), None while it goes on."""
        for i, token in enumerate(tokens):
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"grammar matcher refused token {token}: {_short(self._matcher.get_error())}")
            if self._matcher.is_stopped():
                return i if self._matcher.stop_reason() == "EndOfSentence" else i + 1
        return None


Matcher = GrammarMatcher | AnswerMatcher  # a request's place in its grammar, one interface


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."
