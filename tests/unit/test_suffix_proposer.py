"""Suffix drafting: the shared cache of earlier requests' tokens, its bound and index, and the choice
between a request's own match and the cache's; greedy output through the decode loop stays the target's."""

import asyncio
import random
from array import array

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.suffix_proposer import NgramTable, SuffixCache, SuffixProposer, match_length


def propose(proposer, seq_id, keep, new_ids, k):
    return asyncio.run(proposer.propose(seq_id, keep, new_ids, k, SamplingParams(), 0)).tokens


def test_match_length_counts_the_common_ending():
    assert match_length([1, 2, 3, 4], 4, [9, 2, 3, 4], 4, 10) == 3
    assert match_length([1, 2, 3, 4], 4, [1, 2, 3, 4], 4, 2) == 2  # at most the limit
    assert match_length([1, 2, 3, 4], 2, [5, 1, 2], 3, 10) == 2  # a[:2] against b[:3]
    assert match_length([1], 1, [2], 1, 10) == 0


def test_cache_continues_an_earlier_requests_text():
    cache = SuffixCache(1000, ngram=3)
    cache.add([10, 11, 12, 13, 14, 15, 16])
    # A new sequence ending in [11, 12, 13] (3-gram) continues with what followed it; its match reaches
    # back as far as the two agree.
    assert cache.lookup([5, 11, 12, 13], 2) == (3, [14, 15])
    assert cache.lookup([10, 11, 12, 13], 9) == (4, [14, 15, 16])
    assert cache.lookup([1, 2, 3], 2) == (0, [])  # never seen
    assert cache.lookup([12, 13], 2) == (0, [])  # shorter than the n-gram
    assert cache.lookup([14, 15, 16], 2) == (0, [])  # seen, but nothing followed it


def test_the_newest_occurrence_wins_and_the_oldest_sequences_are_evicted():
    cache = SuffixCache(12, ngram=2)
    cache.add([1, 2, 3, 4, 5])
    cache.add([1, 2, 7, 8, 9])
    assert cache.lookup([0, 1, 2], 3) == (2, [7, 8, 9])  # the later request's continuation
    cache.add([6, 6, 6, 6, 6])  # 15 tokens > 12: the first request goes
    assert [list(kept) for kept in cache.sequences.values()] == [[1, 2, 7, 8, 9], [6, 6, 6, 6, 6]]
    assert cache.tokens == 10
    assert cache.lookup([0, 3, 4], 1) == (0, [])  # its index entries went with it
    assert cache.lookup([0, 1, 2], 1) == (2, [7])  # [1, 2] was the newer request's: kept


def test_the_index_names_exactly_the_latest_occurrences_in_the_sequences_kept():
    check_index_exact(SuffixCache(50, ngram=3), 300, seed=0)


def assert_index_exact(cache):
    """The index names exactly each n-gram's latest occurrence in the sequences kept, and a lookup finds it."""
    latest = {}
    for key, sequence in cache.sequences.items():  # oldest first: later occurrences overwrite
        for end in range(cache.ngram, len(sequence)):
            latest[tuple(sequence[end - cache.ngram:end])] = (key, end)
    assert {gram: cache.index.get(list(gram)) for gram in latest} == latest
    assert len(cache.index) == len(latest) == sum(1 for slot in cache.index.slots if slot)
    for gram, (key, end) in latest.items():
        assert cache.lookup([9, *gram], 2)[1] == cache.sequences[key][end:end + 2].tolist()


def check_index_exact(cache, rounds, seed, alphabet=6):
    """Random adds over a small alphabet (n-grams recur, the oldest sequences go), the index exact after each."""
    rng = random.Random(seed)
    for _ in range(rounds):
        cache.add([rng.randrange(alphabet) for _ in range(rng.randrange(3, 21))])
        assert cache.tokens <= cache.max_tokens
        assert_index_exact(cache)


def test_the_index_stays_exact_when_every_n_gram_collides(monkeypatch):
    """Every n-gram hashed to one of two slots next to the table's end, all with one fingerprint: clusters
    wrap around, a fingerprint match is told apart by the n-gram itself, and a removal shifts the cluster
    back without losing an entry (a wrong shift condition or a trusted fingerprint fails here)."""
    monkeypatch.setattr(NgramTable, "_hash", lambda self, window: (self.mask - sum(window) % 2, 7 << 56))
    monkeypatch.setattr(NgramTable, "_hashes", lambda self, tokens: tuple(map(list, zip(*(
        self._hash(tokens[end - self.n:end]) for end in range(self.n, len(tokens) + 1))))))
    check_index_exact(SuffixCache(40, ngram=3), 150, seed=1)
    check_index_exact(SuffixCache(300, ngram=3), 60, seed=3, alphabet=30)  # clusters of 200 and more


def test_a_removal_moves_back_an_entry_far_from_home(monkeypatch):
    """An n-gram starting with 0 homes at slot 0, any other at 1. The first sequence's one n-gram takes slot 0,
    the second's 300 fill 1..300, the third's three land 301 and more from home; when the first is evicted,
    those three must move back into its slot over 300 entries that may not: their distance is rehashed."""
    monkeypatch.setattr(NgramTable, "_hash", lambda self, window: (int(window[0] != 0), 7 << 56))
    monkeypatch.setattr(NgramTable, "_hashes", lambda self, tokens: tuple(map(list, zip(*(
        self._hash(tokens[end - self.n:end]) for end in range(self.n, len(tokens) + 1))))))
    rng = random.Random(4)
    second = [1 + rng.randrange(40) for _ in range(302)]
    cache = SuffixCache(4 + 302 + 9 + 6, ngram=3)
    for sequence in ([0, 0, 0, 9], second, [0, 1, 1, 0, 2, 2, 0, 3, 3], [5] * 6):
        cache.add(sequence)
        assert_index_exact(cache)
    assert len(cache.sequences) == 4
    cache.add([6, 6])  # too short to keep: nothing goes
    cache.add([7] * 4)  # the first goes
    assert len(cache.sequences) == 4 and cache.index.slots[0] >> 48 & 255 == 0
    assert_index_exact(cache)


def test_a_sequences_hashes_at_once_are_each_n_grams_own():
    rng = random.Random(2)
    table = NgramTable(300_000, 4, None)
    tokens = array("i", [rng.randrange(1 << 24) for _ in range(500)] + [0, 0, 0, 0, (1 << 24) - 1])
    assert list(zip(*table._hashes(tokens))) == [table._hash(tokens[end - 4:end]) for end in range(4, len(tokens) + 1)]
    assert table.bits == 20 and len(NgramTable(262144, 4, None).slots) * 8 == 16 * 262144  # half full at most


def test_a_reset_forgets_every_sequence_and_the_cache_fills_again():
    cache = SuffixCache(100, ngram=2)
    cache.add([1, 2, 3, 4, 5])
    cache.add([6, 7, 8, 9])
    assert cache.clear() == 9
    assert (cache.tokens, cache.sequences, len(cache.index)) == (0, {}, 0) and cache.lookup([0, 1, 2], 2) == (0, [])
    assert not any(cache.index.slots)
    cache.add([1, 2, 7, 7])  # added after the reset: found, and nothing from before it
    assert cache.lookup([0, 1, 2], 3) == (2, [7, 7]) and cache.tokens == 4


def test_a_zero_budget_keeps_nothing():
    cache = SuffixCache(0)
    cache.add(list(range(100)))
    assert not cache.sequences and cache.lookup(list(range(50)), 4) == (0, [])


def test_the_longer_match_proposes_the_requests_own_on_a_tie():
    cache = SuffixCache(1000, ngram=4)
    proposer = SuffixProposer(cache)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert propose(proposer, 1, 0, first, 4) == []  # nothing repeats, the cache is empty
    asyncio.run(proposer.release(1))
    assert 1 not in proposer.sequences and not cache.sequences  # the caller fills the cache
    cache.add(first)
    # Another request reaching [4, 5, 6, 7]: the cache continues it.
    assert propose(proposer, 2, 0, [20, 4, 5, 6, 7], 3) == [8, 9, 10]
    # Its own 2-gram [30, 31] matches too, but the cache's match is longer ([4 ... 8], measured back).
    assert propose(proposer, 3, 0, [30, 31, 40, 3, 4, 5, 6, 7, 30, 31, 4, 5, 6, 7, 8], 2) == [9, 10]
    # A tie goes to the request's own text: both match [5, 6, 7, 8] and no further back.
    own = [50, 5, 6, 7, 8, 60, 61, 51, 5, 6, 7, 8]
    assert propose(proposer, 4, 0, own, 2) == [60, 61]


def test_rollback_and_new_tokens_reach_the_lookup():
    cache = SuffixCache(1000, ngram=4)
    cache.add([1, 2, 3, 4, 5, 6, 7])
    proposer = SuffixProposer(cache)
    assert propose(proposer, 1, 0, [9, 1, 2, 3], 2) == []  # [9, 1, 2, 3]: no 4-gram match
    # The target kept 3 of the 4 tokens and appended 3, 4: [9, 1, 2, 3, 4] ends in [1, 2, 3, 4].
    assert propose(proposer, 1, 3, [3, 4], 2) == [5, 6]
    assert proposer.sequences[1].tokens == [9, 1, 2, 3, 4]


def test_greedy_output_is_the_targets_whatever_the_cache_holds(tiny_lm):
    """Greedy through the decode loop with suffix drafting: the same tokens as target-only, also when the
    cache holds the answer (a repeat: long proposals accepted) or misleading text (rejections)."""
    from specdec.decoding.loop import GenerationRequest
    from specdec.engine.build import dynamic_executor
    from specdec.engine.local import LocalScorer

    from specdec.decoding.draft_length import DraftLengthPolicy
    from specdec.decoding.loop import Stats, generate

    def run(seq_id, proposer, scorer, k):
        stats = Stats()

        async def main():
            return [t async for rnd in generate(GenerationRequest(seq_id, prompt, 24), proposer, scorer,
                                                DraftLengthPolicy.fixed(k), stats) for t in rnd.new_tokens]
        return asyncio.run(main()), stats

    prompt = [5, 17, 3, 88, 41, 9]
    target_only, _ = run(1, SuffixProposer(SuffixCache(0)), LocalScorer(dynamic_executor(tiny_lm)), 0)
    cache = SuffixCache(10_000)
    rng = random.Random(1)
    cache.add(prompt + [rng.randrange(97) for _ in range(40)])  # misleading: the prompt, then noise
    proposer, scorer = SuffixProposer(cache), LocalScorer(dynamic_executor(tiny_lm))
    first, misled = run(2, proposer, scorer, 6)
    cache.add(prompt + first)  # what the orchestrator does when a request ends
    second, repeated = run(3, proposer, scorer, 6)
    assert first == second == target_only
    assert misled.drafted > 0 and misled.accepted < misled.drafted  # the noise was proposed and rejected
    # The repeat drafted from the first request's text: nearly everything accepted, in few rounds.
    assert repeated.accepted >= 0.8 * repeated.drafted and repeated.rounds <= 6, repeated


def test_the_cache_cost_bench_measures_memory_a_token_and_the_times(tmp_path, capsys):
    """`python -m bench.suffix_bench --cache-cost`, small: the cache full, at most 40 bytes a token with its
    index (a dict of Python ints took ~150), each time measured."""
    from bench.suffix_bench import cache_cost

    assert cache_cost(2048, 500, str(tmp_path / "cost.md")) == 0
    rows = [line for line in (tmp_path / "cost.md").read_text().splitlines() if line.startswith("| ")]
    kept, _, per_token, add_us, lookup_us, hits = [cell.strip() for cell in rows[1].split("|")[1:-1]]
    assert 2048 - 400 < int(kept) <= 2048 and int(per_token) <= 40
    assert float(add_us) > 0 and float(lookup_us) > 0 and hits.endswith("of 20000") and int(hits.split()[0]) >= 10000
