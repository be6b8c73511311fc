import asyncio

import pytest
import torch

from specdec.decoding.ngram_proposer import NgramIndex, NgramProposer, lookup
from specdec.decoding.sampling import SamplingParams


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # suffix [1, 2] occurred before: what followed it
    ([1, 2, 3, 9, 1, 2], 1, [3]),
    ([5, 6, 7, 8], 3, []),  # nothing repeats
    ([4, 1, 2, 5, 1, 2, 6, 1, 2], 2, [6, 1]),  # the latest earlier occurrence wins
    ([7, 3, 8, 3], 2, [8, 3]),  # falls back to a 1-gram
    ([1, 2, 3, 4, 2, 3, 4], 5, [2, 3, 4]),  # [2, 3, 4] at 1 is followed by [2, 3, 4]: cut at the end
])
def test_lookup(tokens, k, expected):
    assert lookup(tokens, k) == expected


def test_longer_ngram_preferred_over_more_recent_shorter_one():
    # 2-gram [1, 2] occurs at 0 (followed by 3); the 1-gram [2] occurs later at 5 (followed by 7).
    assert lookup([1, 2, 3, 0, 0, 2, 7, 1, 2], 1) == [3]


def test_min_ngram():
    assert lookup([7, 3, 8, 3], 2, min_ngram=2) == []


def test_proposer_tracks_the_sequence_and_rolls_back():
    proposer = NgramProposer(min_ngram=1)

    async def run():
        first = await proposer.propose(1, 0, [1, 2, 3, 1, 2], 2, SamplingParams(), 0)
        assert first.tokens == [3, 1] and first.cached_length == 5 and first.probs is None
        # The target accepted 3 but not 1, then emitted 9: the orchestrator keeps the proposer's 5 valid
        # tokens and sends what followed them.
        second = await proposer.propose(1, 5, [3, 9], 2, SamplingParams(), 0)
        assert proposer.sequences[1].tokens == [1, 2, 3, 1, 2, 3, 9] and second.tokens == []
        await proposer.release(1)
        assert 1 not in proposer.sequences

    asyncio.run(run())


def test_sampled_lookup_is_verified_as_one_hot_at_the_targets_width():
    """A lookup proposal carries no distribution; the loop verifies it as a one-hot row as wide as the
    target's logits (here 6: a vocabulary padded past the tokenizer's ids), and the output token is
    distributed exactly as the target's."""
    from specdec.decoding.interfaces import Scores
    from specdec.decoding.loop import _verify

    proposer = NgramProposer()
    params = SamplingParams(temperature=1.0)
    proposal = asyncio.run(proposer.propose(1, 0, [1, 0, 2, 1, 0], 1, params, 0))
    assert proposal.tokens == [2] and proposal.probs is None
    target = torch.tensor([[0.1, 0.2, 0.3, 0.3, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    scores = Scores(target.argmax(-1), target.log())
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    n = 20_000
    for _ in range(n):
        verdict = _verify(proposal, scores, scores.logits, params, g)
        counts[2 if verdict.path else verdict.next_token] += 1
    assert float((counts / n - target[0]).abs().sum()) < 0.03


def test_index_equals_the_scan_on_random_sequences_with_rollbacks():
    """The incremental index gives exactly what scanning the whole sequence gives, round after round."""
    import random

    rng = random.Random(0)
    for trial in range(30):
        max_ngram, min_ngram = rng.choice([(4, 2), (3, 1), (2, 2)])
        index = NgramIndex(max_ngram, min_ngram)
        tokens: list[int] = []
        for _ in range(40):
            if tokens and rng.random() < 0.1:  # a rollback
                keep = rng.randrange(len(tokens))
                del tokens[keep:]
                index.truncate(keep)
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]  # small vocabulary: many repeats
            tokens += new
            index.extend(new)
            k = rng.randrange(1, 9)
            assert index.tokens == tokens
            assert index.lookup(k) == lookup(tokens, k, max_ngram, min_ngram), (trial, tokens, k)


# ---- trees: several continuations at once ----------------------------------------------------------
def test_continuations_come_longest_match_and_most_recent_first():
    from specdec.decoding.ngram_proposer import NgramIndex

    index = NgramIndex(3, 1, occurrences=3)
    index.extend([1, 2, 3, 9, 1, 2, 4, 8, 7, 2, 5, 1, 2])
    # "1 2" occurred at 0 and 4 (followed by 3 and 4); then "2" alone at 9 (followed by 5)
    assert index.continuations(2, 5) == [[4, 8], [3, 9], [5, 1]]
    assert index.continuations(2, 1) == [index.lookup(2)] == [[4, 8]]
    plain = NgramIndex(3, 1)  # one occurrence kept: the chain's lookup only
    plain.extend([1, 2, 3, 9, 1, 2, 4, 8, 7, 2, 5, 1, 2])
    assert plain.continuations(2, 5)[0] == [4, 8]


def test_merge_shares_prefixes_and_fills_level_by_level():
    from specdec.decoding.ngram_proposer import merge

    assert merge([[1, 2, 3], [1, 2, 4], [5, 6]], 10) == ([1, 5, 2, 6, 3, 4], (-1, -1, 0, 1, 2, 2))
    assert merge([[1, 2, 3], [5, 6, 7]], 4) == ([1, 5, 2, 6], (-1, -1, 0, 1))  # the budget: both keep a share
    assert merge([[1, 2, 3]], 2) == ([1, 2], (-1, 0))
    assert merge([], 4) == ([], ())


def test_a_branching_proposer_proposes_a_tree_and_a_chain_when_one_continuation():
    import asyncio

    from specdec.decoding.sampling import SamplingParams

    proposer = NgramProposer(max_ngram=2, min_ngram=1, branches=3)
    tree = asyncio.run(proposer.propose(1, 0, [3, 4, 5, 6, 3, 4, 7, 8, 3, 4], 4, SamplingParams(), 0))
    assert tree.tokens == [7, 5, 8, 6] and tree.parents == (-1, -1, 0, 1)
    chain = asyncio.run(proposer.propose(2, 0, [1, 2, 3, 1, 2], 4, SamplingParams(), 0))
    assert chain.tokens == [3, 1, 2] and chain.parents is None
    with pytest.raises(ValueError, match="branches"):
        NgramProposer(branches=0)
