"""Suffix drafting: prompt lookup over the request's own tokens and over earlier requests' text.

Prompt lookup (`ngram_proposer`) finds the sequence's suffix only in its own prompt and output. Workloads
that repeat themselves across requests (agents re-emitting code and tool calls, extraction into one JSON
schema, templated answers) continue text another request already produced; SuffixDecoding (Oliaro et al.
2024) drafts from a store of earlier outputs for that reason. Here `SuffixCache` keeps the token
sequences of finished requests (prompt and output, whatever draft method they used), newest first, up to
a token budget, indexed by their n-grams. A round proposes from whichever match is longer: the latest
earlier occurrence of the suffix in the request's own tokens (ties go to it), or in the cache, each
measured back to `max_match` tokens.

Still a deterministic draft verified by the target: the output is the target's, greedy or sampled, whatever
the cache holds. What the cache changes is how fast a request runs, which depends on other requests'
text: a timing signal across requests, as with any shared cache (`suffix_cache_tokens` 0 keeps none).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from specdec import tensor_names as tn
from specdec.decoding.ngram_proposer import NgramIndex, NgramProposer


def match_length(a: list[int], a_end: int, b: list[int], b_end: int, limit: int) -> int:
    """How many tokens a[:a_end] and b[:b_end] have in common at their ends, at most `limit`."""
    n, top = 0, min(limit, a_end, b_end)
    while n < top and a[a_end - 1 - n] == b[b_end - 1 - n]:
        n += 1
    return n


_BITS = 24  # per token id in an n-gram's key (ids below 2**24: every vocabulary)


def _gram(tokens: list[int], end: int, n: int) -> int:
    """The n tokens before `end` packed into one int: a smaller key than their tuple (memory per token)."""
    key = 0
    for token in tokens[end - n:end]:
        key = key << _BITS | token
    return key


def _grams(tokens: list[int], n: int):
    """(end, `_gram(tokens, end, n)`) for every end from n on, each key rolled from the last."""
    mask, key = (1 << _BITS * n) - 1, _gram(tokens, n - 1, n - 1)
    for end in range(n, len(tokens) + 1):
        key = (key << _BITS | tokens[end - 1]) & mask
        yield end, key


class SuffixCache:
    """Finished requests' token sequences, the newest kept while their tokens sum to at most `max_tokens`
    (0: none kept), and where each `ngram`-gram of them was last followed by a token.

    Adding and evicting a sequence each cost one pass over its tokens (an evicted sequence takes its
    index entries along, unless a newer sequence has taken the n-gram over): no rebuild, so no pause of
    the event loop every request shares (one cache per orchestrator process, no lock)."""

    def __init__(self, max_tokens: int, ngram: int = 4, max_match: int = 64):
        self.max_tokens, self.ngram, self.max_match = max_tokens, ngram, max_match
        # key -> tokens, oldest first; 4 bytes a token in an array (a list's int objects took 36: 147 bytes a
        # token in all with the index, 116 so; docs/results/2026-12-07-orchestrator-memory.md)
        self.sequences: OrderedDict[int, array] = OrderedDict()
        self.tokens = 0  # held in `sequences`
        self.index: dict[int, int] = {}  # n-gram (`_gram`) -> its latest occurrence: key << 32 | its end
        self._next_key = 0

    def add(self, tokens: list[int]) -> None:
        """Keep a finished request's tokens (the last max_tokens of them), evicting the oldest."""
        if not self.max_tokens or len(tokens) <= self.ngram:
            return
        tokens = array("i", tokens[-self.max_tokens:])  # a copy: the cache keeps it
        key, self._next_key = self._next_key, self._next_key + 1
        self.sequences[key] = tokens
        self.tokens += len(tokens)
        self._index(key, tokens)
        while self.tokens > self.max_tokens:
            evicted, sequence = self.sequences.popitem(last=False)
            self.tokens -= len(sequence)
            index, base = self.index, evicted << 32
            for end, gram in _grams(sequence[:-1], self.ngram):
                if index.get(gram) == base | end:
                    del index[gram]

    def clear(self) -> int:
        """Forget every sequence kept (a client's reset of the server's caches); returns the tokens forgotten."""
        forgotten = self.tokens
        self.sequences.clear()
        self.index.clear()
        self.tokens = 0
        return forgotten

    def _index(self, key: int, tokens: array) -> None:
        index, base = self.index, key << 32
        for end, gram in _grams(tokens[:-1], self.ngram):  # an n-gram ending at `end`, followed by tokens[end]
            index[gram] = base | end

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, up to k tokens) continuing the latest cached occurrence of tokens' suffix;
        (0, []) without one of at least `ngram` tokens."""
        if k <= 0 or len(tokens) < self.ngram:
            return 0, []
        hit = self.index.get(_gram(tokens, len(tokens), self.ngram))
        if hit is None:
            return 0, []
        sequence, end = self.sequences[hit >> 32], hit & 0xFFFFFFFF
        return match_length(sequence, end, tokens, len(tokens), self.max_match), sequence[end:end + k].tolist()


class SuffixProposer(NgramProposer):
    """Prompt lookup over a request's own tokens (`NgramProposer`) and the shared `SuffixCache`. What fills
    the cache is the caller's business: the orchestrator adds every finished request's prompt and output,
    whatever its draft method."""

    def __init__(self, cache: SuffixCache, max_ngram: int = tn.LOOKUP_NGRAM[1], min_ngram: int = tn.LOOKUP_NGRAM[0],
                 branches: int = 1):
        super().__init__(max_ngram, min_ngram, branches)
        self.cache = cache

    def _draft(self, index: NgramIndex, k: int) -> list[int]:
        tokens = index.tokens
        end, own = index.match(k)
        theirs_length, theirs = self.cache.lookup(tokens, k)
        # The own match measured as far back as the cache's: the longer one proposes, the own on a tie.
        if theirs and theirs_length > (match_length(tokens, end, tokens, len(tokens), self.cache.max_match)
                                       if own else 0):
            return theirs
        return own

    def _drafts(self, index: NgramIndex, k: int, width: int) -> list[list[int]]:
        """The cache's continuation beside the sequence's own ones (the longer match first, as `_draft`)."""
        first = self._draft(index, k)
        own = index.continuations(k, width)
        theirs = self.cache.lookup(index.tokens, k)[1]
        out = [first] if first else []
        for continuation in own + [theirs]:
            if continuation and continuation not in out and len(out) < width:
                out.append(continuation)
        return out
