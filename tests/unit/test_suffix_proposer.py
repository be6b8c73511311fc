"""Suffix drafting: the shared cache of earlier requests' tokens, its bound and index, and the choice
between a request's own match and the cache's; greedy output through the decode loop stays the target's."""

import asyncio
import random

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.suffix_proposer import SuffixCache, SuffixProposer, _gram, match_length


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
    rng = random.Random(0)
    cache = SuffixCache(50, ngram=3)
    for _ in range(300):
        cache.add([rng.randrange(6) for _ in range(rng.randrange(3, 21))])  # a small alphabet: n-grams recur
        assert cache.tokens <= 50
        latest = {}
        for key, sequence in cache.sequences.items():  # oldest first: later occurrences overwrite
            for end in range(3, len(sequence)):
                latest[tuple(sequence[end - 3:end])] = (key, end)
        assert {gram: cache.index[_gram(list(gram), 3, 3)] for gram in latest} == {
            gram: key << 32 | end for gram, (key, end) in latest.items()} and len(cache.index) == len(latest)


def test_a_reset_forgets_every_sequence_and_the_cache_fills_again():
    cache = SuffixCache(100, ngram=2)
    cache.add([1, 2, 3, 4, 5])
    cache.add([6, 7, 8, 9])
    assert cache.clear() == 9
    assert (cache.tokens, cache.sequences, cache.index) == (0, {}, {}) and cache.lookup([0, 1, 2], 2) == (0, [])
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
