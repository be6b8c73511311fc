"""Structured output: the target's distribution restricted to what a grammar allows, exact under speculation.

A request's guide (a JSON schema, any JSON object, a regex, a GBNF or Lark grammar, or a list of choices)
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

import json
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from specdec import tensor_names as tn

MAX_ERROR_CHARS = 300  # llguidance's messages can quote the whole grammar; a client gets the start


class GuideError(ValueError):
    """A guide that does not compile (its message says why; the caller names the field)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled guide: llguidance's grammar definition and the tokenizer it is matched over."""

    tokenizer: llguidance.LLTokenizer
    definition: str

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


class GuideCompiler:
    """Compiles guides for one tokenizer (converting a Hugging Face tokenizer takes ~0.3 s: once per model
    instance, at load)."""

    def __init__(self, hf_tokenizer):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)

    def compile(self, guide_type: str, guide: str) -> Grammar:
        """guide_type: one of tn.GUIDE_TYPES; guide: its text (ignored for "json"). Raises GuideError."""
        if guide_type not in tn.GUIDE_TYPES:
            raise GuideError(f"unknown guide type {guide_type!r} (one of {', '.join(tn.GUIDE_TYPES)})")
        if guide_type != "json" and not guide:  # (a lone space is a valid regex)
            raise GuideError(f"a {guide_type} guide is empty")
        try:
            if guide_type == "choice":
                choices = json.loads(guide)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                    raise GuideError("a choice guide must be a JSON list of non-empty strings")
                definition = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(choice) for choice in choices))
            elif guide_type == "json":
                definition = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            else:
                definition = llguidance.grammar_from(
                    {"json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "grammar"}[guide_type], guide)
        except GuideError:
            raise
        except ValueError as exc:  # not JSON, or a grammar that does not convert
            raise GuideError(_short(str(exc))) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, self.tokenizer)
        if failed:
            raise GuideError(_short(messages[0]))
        return Grammar(self.tokenizer, definition)


class GrammarMatcher:
    """One request's place in its grammar: it has consumed the request's output so far."""

    def __init__(self, grammar: Grammar):
        self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.definition, log_level=0)
        if self._matcher.is_error():
            raise GuideError(_short(self._matcher.get_error()))
        self._tokenizer = grammar.tokenizer
        self.vocab_size = grammar.tokenizer.vocab_size

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

    def allowed(self, draft: list[int], positions: int, width: int) -> torch.Tensor:
        """(positions, width) bool: the tokens allowed at each verify position; position j follows the output
        so far plus draft[:j]. Rows after the first draft token the grammar refuses allow everything (the
        verdict never reads them). Ids at or beyond the tokenizer's vocabulary are never allowed."""
        valid = self.valid_prefix(draft[:positions - 1])
        rows = []
        for j in range(valid + 1):
            rows.append(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32))
            if j < valid and not self._matcher.consume_token(draft[j]):
                raise RuntimeError(f"grammar matcher: {_short(self._matcher.get_error())}")
        if valid and not self._matcher.rollback(valid):
            raise RuntimeError(f"grammar matcher: {_short(self._matcher.get_error())}")
        # Bit i of 32-bit word w is token 32 w + i (little-endian words, little-endian bits).
        unpacked = np.unpackbits(np.stack(rows).view(np.uint8), axis=1, bitorder="little")[:, :min(width, self.vocab_size)]
        allowed = torch.zeros(positions, width, dtype=torch.bool)
        allowed[valid + 1:] = True
        allowed[:valid + 1, :unpacked.shape[1]] = torch.from_numpy(unpacked.astype(bool))
        return allowed

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


def mask_disallowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [P, V] with every token `allowed` [P, V] (bool) leaves out set to -inf (a copy)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."
