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

import numpy as np

from specdec import tensor_names as tn
from specdec.decoding.ngram_proposer import NgramIndex, NgramProposer


def match_length(a: list[int], a_end: int, b: list[int], b_end: int, limit: int) -> int:
    """How many tokens a[:a_end] and b[:b_end] have in common at their ends, at most `limit`."""
    n, top = 0, min(limit, a_end, b_end)
    while n < top and a[a_end - 1 - n] == b[b_end - 1 - n]:
        n += 1
    return n


# A slot: fingerprint | distance from its home slot | sequence key | end, 8 + 8 + 24 + 24 bits; 0 is an empty
# slot (an end is >= n >= 1). The distance saves rehashing an entry when a removal shifts it back; 255 is "255 or
# more: rehash it".
_FIELD = 24
_FIELD_MASK = (1 << _FIELD) - 1
_PLACE = (1 << 2 * _FIELD) - 1  # key | end: one occurrence
_FAR = 255
_KEEP = ~(_FAR << 48)  # all but the distance
MAX_TOKENS = _FIELD_MASK  # the most a cache keeps: every live key and every end fit their 24 bits
_M64 = (1 << 64) - 1
_P, _MIX, _MIX_FP = 0x100000001B3, 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F  # odd 64-bit multipliers


def _poly(window) -> int:
    """An n-gram's 64-bit polynomial hash (`NgramTable._hashes` computes the same for every window at once)."""
    x = 0
    for token in window:
        x = (x * _P + token + 1) & _M64
    return x


class NgramTable:
    """Where each n-gram of `SuffixCache`'s sequences last occurred: a flat open-addressing table.

    A dict of packed n-grams to packed positions took ~110 bytes a cached token (two int objects and a
    hash-table entry each); here an 8-byte slot an entry in an array of 2**bits slots, at most half full,
    allocated at the start for the cache's budget (an n-gram entry per token at most): 16 bytes a token of
    a power-of-two budget such as the default, up to 32 otherwise. Linear probing; an entry's home slot and
    8-bit fingerprint come from its n-gram's hash, and a fingerprint match is confirmed by the n-gram itself,
    read back from the sequence the slot names (`tokens_of`): the table is exact. A removal shifts the rest of
    its cluster back (no tombstones, so no rebuild and no pause of the event loop that serves every stream).
    A sequence's hashes are computed at once (numpy): what is left in Python per token is the probing."""

    def __init__(self, entries: int, n: int, tokens_of):
        self.n, self.tokens_of = n, tokens_of  # tokens_of(key) -> the sequence that key names
        self.bits = max(4, (2 * entries - 1).bit_length())
        self.mask = (1 << self.bits) - 1
        self.slots = array("Q", [0]) * (1 << self.bits)
        self.entries = 0

    def clear(self) -> None:
        self.slots = array("Q", [0]) * (1 << self.bits)
        self.entries = 0

    def __len__(self) -> int:
        return self.entries

    def _hash(self, window) -> tuple[int, int]:
        """(home slot, fingerprint << 56) of one n-gram: `_hashes`'s figures for it."""
        x = _poly(window)
        return (x * _MIX & _M64) >> (64 - self.bits), (x * _MIX_FP & _M64) >> 56 << 56

    def _hashes(self, tokens: array) -> tuple[list[int], list[int]]:
        """(home slots, fingerprints << 56) of the n-grams ending at n .. len(tokens), first to last."""
        ids = np.frombuffer(tokens, dtype=np.int32).astype(np.uint64) + np.uint64(1)
        windows = len(ids) - self.n + 1
        x = np.zeros(windows, dtype=np.uint64)
        for i in range(self.n):  # uint64 arithmetic wraps: the same as `_poly`'s mod 2**64
            x = x * np.uint64(_P) + ids[i:i + windows]
        homes = (x * np.uint64(_MIX)) >> np.uint64(64 - self.bits)
        return homes.tolist(), ((x * np.uint64(_MIX_FP)) >> np.uint64(56) << np.uint64(56)).tolist()

    def _window(self, slot: int):
        end = slot & _FIELD_MASK
        return self.tokens_of(slot >> _FIELD & _FIELD_MASK)[end - self.n:end]

    def get(self, window: list[int]) -> tuple[int, int] | None:
        """(sequence key, end) of the latest occurrence of the n-gram `window` followed by a token, or None."""
        (i, fingerprint), slots, mask = self._hash(window), self.slots, self.mask
        while slot := slots[i]:
            if slot >> 56 << 56 == fingerprint and self._window(slot).tolist() == window:
                return slot >> _FIELD & _FIELD_MASK, slot & _FIELD_MASK
            i = (i + 1) & mask
        return None

    def add(self, key: int, tokens: array) -> None:
        """Index every n-gram of `tokens` that a token follows as its latest occurrence (sequence `key`)."""
        if len(tokens) <= self.n:
            return
        n, slots, mask, far = self.n, self.slots, self.mask, _FAR
        homes, fingerprints = self._hashes(tokens[:-1])
        added = 0
        for end, i, fingerprint in zip(range(n, len(tokens)), homes, fingerprints):
            distance = 0
            while slot := slots[i]:
                if slot >> 56 << 56 == fingerprint and self._window(slot) == tokens[end - n:end]:
                    break  # an earlier occurrence: this one is the latest
                i, distance = (i + 1) & mask, distance + 1
            else:
                added += 1
            slots[i] = fingerprint | (distance if distance < far else far) << 48 | key << _FIELD | end
        self.entries += added

    def remove(self, key: int, tokens: array) -> None:
        """Drop the entries `add(key, tokens)` made that no later sequence has taken over."""
        if len(tokens) <= self.n:
            return
        slots, mask, base, far, keep, place_mask = self.slots, self.mask, key << _FIELD, _FAR, _KEEP, _PLACE
        removed = 0
        for place, i in zip(range(base | self.n, base | len(tokens)), self._hashes(tokens[:-1])[0]):
            while (slot := slots[i]) and slot & place_mask != place:
                i = (i + 1) & mask
            if not slot:
                continue  # taken over
            removed += 1
            j = i  # shift the cluster's later entries back where their probe path allows: no hole inside it
            while slot := slots[(j := (j + 1) & mask)]:
                distance = slot >> 48 & far
                if distance == far:
                    distance = (j - self._hash(self._window(slot))[0]) & mask
                gap = (j - i) & mask
                if gap <= distance:  # its home is at or before the hole: move it there
                    distance -= gap
                    slots[i], i = slot & keep | (distance if distance < far else far) << 48, j
            slots[i] = 0
        self.entries -= removed


class SuffixCache:
    """Finished requests' token sequences, the newest kept while their tokens sum to at most `max_tokens`
    (0: none kept; at most `MAX_TOKENS`), and where each `ngram`-gram of them was last followed by a token.

    Adding and evicting a sequence each cost one pass over its tokens (an evicted sequence takes its
    index entries along, unless a newer sequence has taken the n-gram over): no rebuild, so no pause of
    the event loop every request shares (one cache per orchestrator process, no lock). Memory: 4 bytes a
    token kept and the index's 16 (`NgramTable`, allocated at the start): 20 bytes a token of the budget."""

    def __init__(self, max_tokens: int, ngram: int = 4, max_match: int = 64):
        if not 0 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"a suffix cache keeps at most {MAX_TOKENS} tokens, got {max_tokens}")
        self.max_tokens, self.ngram, self.max_match = max_tokens, ngram, max_match
        self.sequences: OrderedDict[int, array] = OrderedDict()  # key -> tokens (4 bytes each), oldest first
        self.tokens = 0  # held in `sequences`
        self.index = NgramTable(max_tokens, ngram, self.sequences.__getitem__)
        self._next_key = 0

    def add(self, tokens: list[int]) -> None:
        """Keep a finished request's tokens (the last max_tokens of them), evicting the oldest."""
        if not self.max_tokens or len(tokens) <= self.ngram:
            return
        tokens = array("i", tokens[-self.max_tokens:])  # a copy: the cache keeps it
        # Keys wrap at 24 bits: a live sequence holds more than `ngram` tokens, so fewer than 2**24 live at once
        key, self._next_key = self._next_key, (self._next_key + 1) & _FIELD_MASK
        self.sequences[key] = tokens
        self.tokens += len(tokens)
        self.index.add(key, tokens)
        while self.tokens > self.max_tokens:
            evicted, sequence = next(iter(self.sequences.items()))  # still readable while its entries go
            self.index.remove(evicted, sequence)
            del self.sequences[evicted]
            self.tokens -= len(sequence)

    def clear(self) -> int:
        """Forget every sequence kept (a client's reset of the server's caches); returns the tokens forgotten."""
        forgotten = self.tokens
        self.sequences.clear()
        self.index.clear()
        self.tokens = 0
        return forgotten

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, up to k tokens) continuing the latest cached occurrence of tokens' suffix;
        (0, []) without one of at least `ngram` tokens."""
        if k <= 0 or len(tokens) < self.ngram:
            return 0, []
        hit = self.index.get(tokens[-self.ngram:])
        if hit is None:
            return 0, []
        sequence, end = self.sequences[hit[0]], hit[1]
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
