"""Prompt lookup first, a model draft otherwise (lookup_first.py): which proposes, and the model's cache
kept consistent across the rounds it was not called, through the real decode loop against fakes that keep
real per-sequence caches (test_loop's)."""

import asyncio

import pytest

from specdec.decoding.draft_length import CostModel, DraftLengthPolicy, PartPolicies
from specdec.decoding.interfaces import Proposal
from specdec.decoding.lookup_first import LOOKUP, MODEL, LookupFirstProposer, parts
from specdec.decoding.loop import GenerationRequest, Stats
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.suffix_proposer import SuffixCache, SuffixProposer
from tests.unit.test_loop import FakeProposer, FakeScorer, reference_greedy, run


class RecordingModel(FakeProposer):
    """A model draft that checks it is sent exactly the tokens it has not cached: its cache must equal the
    sequence's tokens before each proposal (the fake's predictions are computed from the cache)."""

    def __init__(self, agree_every=0, truth=None):
        super().__init__(agree_every)
        self.sent = []  # (keep, new_ids, reserve) per call
        self.asked = []  # k per call
        self.truth = truth  # the whole sequence the loop will produce, where known

    async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0, **options):
        self.sent.append((keep, list(new_ids), reserve))
        self.asked.append(k)
        proposal = await super().propose(seq_id, keep, new_ids, k, params, round_seed, reserve)
        if self.truth is not None:  # what it drafted from is the sequence so far
            assert self.caches[seq_id][:keep + len(new_ids)] == self.truth[:keep + len(new_ids)]
        return proposal


def test_combined_names():
    assert parts("ngram+draft_head") == ("ngram", "draft_head")
    assert parts("ngram") is None and parts("+x") is None and parts("ngram+") is None


@pytest.mark.parametrize("agree_every", [0, 3])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_lookup_first_keeps_the_output_and_the_models_cache(agree_every, policy):
    # The target's 'language' runs into a cycle of 4 tokens after this prompt: the first rounds find no
    # earlier n-gram (the model drafts), the later ones copy the cycle (the lookup drafts)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    whole = prompt + reference_greedy(prompt, 40)
    model = RecordingModel(agree_every, truth=whole)
    proposer = LookupFirstProposer(NgramProposer(), model, min_ngram=2)
    choose = proposer.choose

    def checked(seq_id, keep, new_ids):  # the lookup holds the whole sequence so far, never less
        part = choose(seq_id, keep, new_ids)
        assert proposer.lookup.sequences[seq_id].tokens == whole[:keep + len(new_ids)]
        return part

    proposer.choose = checked
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=40)
    pol = DraftLengthPolicy.fixed(4) if policy == "fixed" else DraftLengthPolicy(4, DraftLengthPolicy.fixed(4).costs, "x")
    rounds = run(req, proposer, FakeScorer(), pol, Stats())
    assert [tok for rnd in rounds for tok in rnd.new_tokens] == whole[len(prompt):]
    # Both parts draft. An adaptive K prices rounds by measured times (the fakes' microseconds): it may pause
    # the draft and, where a hiccup made it look costly, probe no more, so whether the lookup drafted then
    # depends on the machine's load (seen in CI: after a never-accepted model, and after one accepted every
    # third round on a loaded machine); the fixed K's cases check that the lookup drafts.
    assert proposer.model_rounds > 0 and (proposer.lookup_rounds > 0 or policy == "adaptive")
    # The model's first call carried the whole sequence so far (and the reserve), and every call after kept
    # at most what it held (the fake asserts) and was sent the rest
    assert model.sent[0][0] == 0 and model.sent[0][2] > 0
    assert all(reserve == 0 for _, _, reserve in model.sent[1:])


def test_the_lookup_drafts_only_on_a_long_enough_match():
    async def main():
        model = RecordingModel()
        proposer = LookupFirstProposer(NgramProposer(), model, min_ngram=3)
        params = SamplingParams()
        seq = [7, 8, 9, 1, 2, 7, 8]  # suffix (7, 8) matched before, a 2-gram only: the model drafts
        first = await proposer.propose(1, 0, seq, 3, params, 0, reserve=32)
        assert len(model.sent) == 1 and first.cached_length == len(seq) + 2
        # the round accepted nothing; the next token makes (7, 8, 9) a 3-gram seen before: the lookup drafts
        second = await proposer.propose(1, len(seq), [9], 3, params, 0)
        assert second.tokens == [1, 2, 7] and len(model.sent) == 1 and second.cached_length == len(seq)
        # the model's next call is sent everything since its valid prefix
        await proposer.propose(1, second.cached_length, [9, 1, 2, 7, 8, 5, 6], 3, params, 0)
        assert model.sent[-1][:2] == (len(seq), [9, 1, 2, 7, 8, 5, 6])
        await proposer.release(1)
        assert not proposer.model_valid and model.caches == {}

    asyncio.run(main())


def test_only_prompt_lookup_goes_first():
    with pytest.raises(ValueError, match="prompt lookup"):
        LookupFirstProposer(SuffixProposer(SuffixCache(64)), RecordingModel())
    with pytest.raises(ValueError, match="min_ngram"):
        LookupFirstProposer(NgramProposer(min_ngram=2), RecordingModel(), min_ngram=1)


def test_each_part_drafts_under_its_own_policy():
    """The loop asks which part drafts before it asks for k: lookup rounds are priced by the lookup's policy
    (here up to 6 tokens), the model's by the model's (2), and each learns only from its own rounds."""
    start = [3, 1, 4, 1, 5, 9, 2, 6]  # as above: the model drafts first, then the lookup copies a cycle
    whole = start + reference_greedy(start, 40)
    model = RecordingModel(agree_every=3, truth=whole)
    proposer = LookupFirstProposer(NgramProposer(), model, min_ngram=2)
    lookup, drafting = DraftLengthPolicy.fixed(6, "lookup"), DraftLengthPolicy.fixed(2, "model")
    policy = PartPolicies({LOOKUP: lookup, MODEL: drafting})
    stats = Stats()
    rounds = run(GenerationRequest(seq_id=1, prompt_ids=start, max_tokens=40), proposer, FakeScorer(), policy, stats)
    assert [tok for rnd in rounds for tok in rnd.new_tokens] == whole[len(start):]
    assert proposer.lookup_rounds > 0 and proposer.model_rounds > 0
    assert set(model.asked) <= {1, 2} and max(rnd.num_drafted for rnd in rounds) > 2  # the lookup's longer spans
    # Each policy's acceptance counts come from its own rounds only
    assert lookup.costs.alpha and drafting.costs.alpha and lookup.costs is not drafting.costs
    assert sum(rnd.num_drafted for rnd in rounds) == stats.drafted


def test_part_policies_delegate_to_the_selected_part():
    costs = CostModel()
    policy = PartPolicies({LOOKUP: DraftLengthPolicy(8, costs, "ngram+x", free=True),
                           MODEL: DraftLengthPolicy(3, costs, "x")})
    assert policy.k_max == 8 and policy.free
    policy.select(MODEL)
    assert policy.k_max == 3 and not policy.free and policy.method == "x"
    with pytest.raises(KeyError):
        policy.select("other")


def test_a_trees_first_branch_is_what_the_model_holds():
    from specdec.decoding.lookup_first import _first_branch

    tree = Proposal([5, 6, 7, 8, 9], None, 0, parents=(-1, -1, 0, 0, 2))  # 5 -> 7 -> 9 first; 6, 8 siblings
    assert _first_branch(tree) == [5, 7, 9]
    assert _first_branch(Proposal([1, 2], None, 0)) == [1, 2]


def test_a_model_call_after_lookup_rounds_is_not_timed_as_a_round():
    """The model's first call after rounds the lookup drafted catches up on them (here it takes 50 ms): the
    loop does not time it (the next steady call is), or the model's cost would be read from its catch-ups."""
    import time

    class SlowCatchUp(RecordingModel):
        catch_ups = 0

        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0, **options):
            if seq_id in proposer.behind:
                self.catch_ups += 1
                time.sleep(0.05)
            return await super().propose(seq_id, keep, new_ids, k, params, round_seed, reserve, **options)

    start = [3, 1, 4, 1, 5, 9, 2, 6]
    model = SlowCatchUp(agree_every=3)
    proposer = LookupFirstProposer(NgramProposer(), model, min_ngram=2)
    choose, rounds = proposer.choose, []

    def every_third_round_the_lookup(seq_id, keep, new_ids):
        choose(seq_id, keep, new_ids)
        rounds.append(None)
        proposer.chosen[seq_id] = part = LOOKUP if len(rounds) % 3 == 0 else MODEL
        return part

    proposer.choose = every_third_round_the_lookup
    costs, seen = CostModel(), []
    observe = costs.observe_draft
    costs.observe_draft = lambda method, tokens, seconds, forward=None: seen.append((method, seconds)) or observe(
        method, tokens, seconds, forward)
    policy = PartPolicies({LOOKUP: DraftLengthPolicy(4, costs, "ngram+m", free=True, adaptive=False),
                           MODEL: DraftLengthPolicy(4, costs, "m", adaptive=False)})
    out = run(GenerationRequest(seq_id=1, prompt_ids=start, max_tokens=40), proposer, FakeScorer(), policy, Stats())
    assert [tok for rnd in out for tok in rnd.new_tokens] == reference_greedy(start, 40)
    assert model.catch_ups >= 3 and any(method == "m" for method, _ in seen)
    assert all(seconds < 0.025 for method, seconds in seen if method == "m")
