"""The decode loop against scripted fakes that keep real per-sequence caches (token lists).

The fakes compute every prediction from their own cached context, so any bookkeeping error (a wrong
rollback point, a token sent twice or missed) changes the output and fails the comparison with plain
greedy decoding.
"""

import asyncio

import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.draft_length import CostModel, DraftLengthPolicy
from specdec.decoding.interfaces import ForwardStats, NoCapacity, Proposal, Scores
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.sampling import SamplingParams

VOCAB = 50


def true_next(context):
    """The target's deterministic greedy 'language'."""
    return (sum(context) * 31 + 7 * len(context)) % VOCAB


def draft_next(context, agree_every):
    """Agrees with the target except every `agree_every`-th position (0: always agrees)."""
    token = true_next(context)
    if agree_every and len(context) % agree_every == 0:
        token = (token + 1) % VOCAB
    return token


class FakeModel:
    def __init__(self):
        self.caches = {}
        self.tokens_processed = 0
        self.calls = 0
        self.released = []
        self.reserves = []  # every call's reserve
        self.peak = 0  # the longest any cache has been

    def _extend(self, seq_id, keep, new_ids):
        cache = self.caches.setdefault(seq_id, [])
        assert keep <= len(cache), "asked to keep more than is cached"
        del cache[keep:]
        cache.extend(new_ids)
        self.tokens_processed += len(new_ids)
        self.calls += 1
        self.peak = max(self.peak, len(cache))
        return cache

    async def release(self, seq_id):
        self.released.append(seq_id)
        self.caches.pop(seq_id, None)


class FakeScorer(FakeModel):
    async def score(self, call):
        self.reserves.append(call.reserve)
        cache = self._extend(call.seq_id, call.keep, call.new_ids)
        n = len(cache)
        greedy = [true_next(cache[:i]) for i in range(n - call.num_positions + 1, n + 1)]
        return Scores(torch.tensor(greedy), None)


class FakeProposer(FakeModel):
    def __init__(self, agree_every=0):
        super().__init__()
        self.agree_every = agree_every

    async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
        self.reserves.append(reserve)
        cache = self._extend(seq_id, keep, new_ids)
        context = list(cache)
        tokens = []
        for step in range(k):
            tokens.append(draft_next(context, self.agree_every))
            context.append(tokens[-1])
            if step < k - 1:
                self._extend(seq_id, len(cache), [tokens[-1]])
        return Proposal(tokens, None, cached_length=len(cache))


def reference_greedy(prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(true_next(ids))
    return ids[len(prompt):]


def run(req, proposer, scorer, policy, stats=None):
    async def collect():
        out = []
        async for rnd in generate(req, proposer, scorer, policy, stats):
            out.append(rnd)
        return out

    return asyncio.run(collect())


@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("agree_every", [0, 2, 3, 7])
def test_greedy_output_equals_target_only(k, agree_every):
    prompt = [3, 1, 4, 1, 5]
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=40)
    stats = Stats()
    proposer, scorer = FakeProposer(agree_every), FakeScorer()
    rounds = run(req, proposer, scorer, DraftLengthPolicy.fixed(k), stats)
    output = [tok for rnd in rounds for tok in rnd.new_tokens]
    assert output == reference_greedy(prompt, 40)
    assert rounds[-1].finish_reason == tn.FINISH_LENGTH
    # Token budget: each model processes at most P + R * (K + 1) tokens.
    bound = len(prompt) + stats.rounds * (k + 1)
    assert scorer.tokens_processed <= bound
    assert proposer.tokens_processed <= bound
    assert stats.rounds == scorer.calls
    if k and agree_every == 0:
        assert stats.acceptance_rate == 1.0
    # Both caches are released at the end.
    assert scorer.released == [1] and (proposer.released == [1] if k else proposer.released == [])


@pytest.mark.parametrize("agree_every", [0, 2, 7])
def test_adaptive_draft_length_keeps_the_output_and_feeds_the_policy(agree_every):
    prompt = [3, 1, 4, 1, 5]
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=60)
    costs = CostModel()
    policy = DraftLengthPolicy(8, costs, "fake")
    stats = Stats()
    rounds = run(req, FakeProposer(agree_every), FakeScorer(), policy, stats)
    assert [tok for rnd in rounds for tok in rnd.new_tokens] == reference_greedy(prompt, 60)
    assert all(rnd.num_drafted <= 8 for rnd in rounds)
    # Every plain round was timed by its number of positions, and the draft per token.
    assert costs.verify_s and all(1 <= n <= 9 for n in costs.verify_s) and "fake" in costs.draft_s
    if agree_every == 0:  # a perfect draft: acceptance stays high, drafts stay long
        assert policy.alpha > 0.9 and stats.acceptance_rate == 1.0
    if agree_every == 2:  # a draft wrong at every other token: the policy drafts less than the maximum
        assert stats.drafted < 8 * stats.rounds


def test_perfect_draft_needs_few_rounds():
    req = GenerationRequest(seq_id=1, prompt_ids=[1, 2], max_tokens=20)
    stats = Stats()
    run(req, FakeProposer(0), FakeScorer(), DraftLengthPolicy.fixed(4), stats)
    assert stats.rounds == 4  # 5 tokens per round
    assert stats.mean_accepted_length == 5.0
    assert stats.accepted_per_position == [4, 4, 4, 4]


def test_never_drafts_past_max_tokens():
    req = GenerationRequest(seq_id=1, prompt_ids=[1, 2], max_tokens=6)
    stats = Stats()
    rounds = run(req, FakeProposer(0), FakeScorer(), DraftLengthPolicy.fixed(8), stats)
    assert [len(r.new_tokens) for r in rounds] == [6]
    assert stats.drafted == 5


def test_stops_at_end_id_and_drops_it():
    prompt = [3, 1, 4]
    expected = reference_greedy(prompt, 30)
    end = expected[5]
    first = expected.index(end)
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=30,
                            end_ids=frozenset([end]))
    rounds = run(req, FakeProposer(3), FakeScorer(), DraftLengthPolicy.fixed(3))
    assert [t for r in rounds for t in r.new_tokens] == expected[:first]
    assert rounds[-1].finish_reason == tn.FINISH_STOP


def test_end_tokens_before_min_tokens_are_generated_like_others():
    prompt = [3, 1, 4]
    expected = reference_greedy(prompt, 30)
    end = expected[0]
    later = next(i for i, t in enumerate(expected) if t == end and i >= 4)
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=30, end_ids=frozenset([end]), min_tokens=4)
    rounds = run(req, FakeProposer(3), FakeScorer(), DraftLengthPolicy.fixed(3))
    assert [t for r in rounds for t in r.new_tokens] == expected[:later]
    assert rounds[-1].finish_reason == tn.FINISH_STOP


def test_caches_released_when_consumer_stops_early():
    proposer, scorer = FakeProposer(2), FakeScorer()
    req = GenerationRequest(seq_id=9, prompt_ids=[1, 2, 3], max_tokens=50)

    async def take_two():
        rounds = generate(req, proposer, scorer, DraftLengthPolicy.fixed(3))
        await rounds.__anext__()
        await rounds.__anext__()
        await rounds.aclose()  # what cancellation does

    asyncio.run(take_two())
    assert proposer.released == [9] and scorer.released == [9]


def test_caches_released_when_a_call_fails():
    class FailingScorer(FakeScorer):
        async def score(self, *args, **kwargs):
            if self.calls == 2:
                raise RuntimeError("target died")
            return await super().score(*args, **kwargs)

    proposer, scorer = FakeProposer(), FailingScorer()
    req = GenerationRequest(seq_id=4, prompt_ids=[1, 2], max_tokens=50)
    with pytest.raises(RuntimeError, match="target died"):
        run(req, proposer, scorer, DraftLengthPolicy.fixed(2))
    assert proposer.released == [4] and scorer.released == [4]


@pytest.mark.parametrize("k", [0, 1, 4])
def test_first_calls_reserve_what_the_caches_ever_hold(k):
    """Each model's first call asks for room for the whole generation (prompt + max_tokens), the others
    for none, and no cache grows past it (it is what a KV budget sets aside at the start)."""
    proposer, scorer = FakeProposer(agree_every=3), FakeScorer()
    req = GenerationRequest(seq_id=1, prompt_ids=[4, 8, 15], max_tokens=23)
    run(req, proposer, scorer, DraftLengthPolicy.fixed(k))
    for model in (scorer, proposer) if k else (scorer,):
        assert model.reserves[0] == 3 + 23 and not any(model.reserves[1:])
        assert model.peak <= 3 + 23
    assert scorer.peak >= 3 + 23 - 1  # the bound is tight: the last round's verify nearly fills it


class RoomlessScorer(FakeScorer):
    """Has no room for a new sequence for its first `full_for` first calls."""

    def __init__(self, full_for):
        super().__init__()
        self.full_for = full_for

    async def score(self, call):
        if call.reserve and self.full_for:
            self.full_for -= 1
            raise NoCapacity("target_model: KV cache budget full")
        return await super().score(call)


def test_a_new_sequence_waits_for_room_and_keeps_its_output():
    proposer, scorer = FakeProposer(agree_every=3), RoomlessScorer(full_for=3)
    waits = []

    async def wait_for_room():
        waits.append(1)
        return True

    async def go():
        rounds = generate(GenerationRequest(seq_id=2, prompt_ids=[1, 2, 3], max_tokens=20), proposer, scorer,
                          DraftLengthPolicy.fixed(3), wait_for_room=wait_for_room)
        return [t async for r in rounds for t in r.new_tokens]

    assert asyncio.run(go()) == reference_greedy([1, 2, 3], 20)
    assert len(waits) == 3
    assert proposer.reserves.count(3 + 20) == 1  # the draft's first proposal was not redone while waiting


@pytest.mark.parametrize("waiter", [None, "gives up"])
def test_no_room_and_no_wait_raises_and_releases(waiter):
    proposer, scorer = FakeProposer(), RoomlessScorer(full_for=1)

    async def give_up():
        return False

    async def go():
        rounds = generate(GenerationRequest(seq_id=5, prompt_ids=[1, 2], max_tokens=8), proposer, scorer,
                          DraftLengthPolicy.fixed(2), wait_for_room=give_up if waiter else None)
        return [t async for r in rounds for t in r.new_tokens]

    with pytest.raises(NoCapacity, match="budget full"):
        asyncio.run(go())
    assert proposer.released == [5] and scorer.released == [5]


@pytest.mark.parametrize("proposed, accepted", [(1, True), (3, False)])
def test_sampled_rounds_accept_by_the_target_and_draft_probs(proposed, accepted):
    """A sampled request asks the scorer for logits and verifies the draft's distributions against them.
    The target puts (almost) all its mass on token 1: a draft proposing 1 is accepted every time, one
    proposing 3 (with probability 1 under the draft) is rejected every time and replaced by 1. An
    always-accept or always-reject rule fails one of the two cases."""
    vocab = 5

    class SampledScorer(FakeModel):
        async def score(self, call):
            assert call.want_logits
            self._extend(call.seq_id, call.keep, call.new_ids)
            logits = torch.full((call.num_positions, vocab), -30.0)
            logits[:, 1] = 30.0
            return Scores(logits.argmax(-1), logits)

    class SampledProposer(FakeModel):
        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
            cache = self._extend(seq_id, keep, new_ids + [proposed] * (k - 1))
            probs = torch.nn.functional.one_hot(torch.tensor([proposed] * k), vocab).float()
            return Proposal([proposed] * k, probs, cached_length=len(cache))

    req = GenerationRequest(seq_id=1, prompt_ids=[1], max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=5))
    stats = Stats()
    first = run(req, SampledProposer(), SampledScorer(), DraftLengthPolicy.fixed(3), stats)
    again = run(req, SampledProposer(), SampledScorer(), DraftLengthPolicy.fixed(3), Stats())
    assert [t for r in first for t in r.new_tokens] == [1] * 12
    assert stats.acceptance_rate == (1.0 if accepted else 0.0)
    assert [r.new_tokens for r in first] == [r.new_tokens for r in again]  # seeded: reproducible


def test_paused_free_proposer_is_checked_in_the_shadow_and_feeds_forward_costs():
    """Under a load where verifying costs too much (v(k) from batched forwards), a free proposer's
    rounds verify nothing: the output is target-only's, nothing counts as drafted, but every shadow
    proposal is checked against the target's token and the forward costs reach the cost model."""
    class LoadedScorer(FakeScorer):
        async def score(self, call):
            scores = await super().score(call)
            # 8 sequences per forward; rows cost a lot once the forward holds more than 8 of them.
            n = call.num_positions
            return Scores(scores.greedy_tokens, None, forward=ForwardStats(8 * n, 8, 0.05 * n))

    class CountingProposer(FakeProposer):
        asked = []

        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
            self.asked.append(k)
            return await super().propose(seq_id, keep, new_ids, k, params, round_seed)

    prompt = [3, 1, 4, 1, 5]
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=30)
    costs = CostModel()
    for rows in (8, 16, 72):
        costs.observe_forward(ForwardStats(rows, 8, 0.05 * rows / 8))  # T(8(k+1)) = (k+1) T(8): drafting never pays
    policy = DraftLengthPolicy(8, costs, "ngram", free=True)
    policy.successes, policy.failures, policy.prior_weight = 0.0, 5.0, 0.0  # a poor record so far
    proposer, stats = CountingProposer(agree_every=2), Stats()
    rounds = run(req, proposer, LoadedScorer(), policy, stats)
    assert [tok for rnd in rounds for tok in rnd.new_tokens] == reference_greedy(prompt, 30)
    assert stats.drafted == 0 and len(rounds) == 30  # target-only rounds
    assert proposer.asked and set(proposer.asked) == {1}  # shadow proposals, one token each
    assert policy.successes > 0  # its correct first tokens were seen
    assert 8 in costs.forward_s and round(costs.sequences.value) == 8


def test_features_held_for_a_head_are_the_rows_since_it_last_read():
    from specdec.decoding.loop import Features
    rows = torch.arange(40.0).reshape(20, 2)  # position p's row: [2p, 2p + 1]
    held = Features()
    held.add(rows[:10], 10, 10)  # a prompt's verify: positions 0-9
    held.add(rows[10:13], 13, 11)  # 3 positions verified, 1 accepted: 10, and 11 rejected past it
    assert torch.equal(held.since(4), rows[4:11])
    for p in range(11, 15):  # paused rounds: one row each, kept apart until read
        held.add(rows[p:p + 1], p + 1, p + 1)
    assert len(held.parts) == 5 and torch.equal(held.since(12), rows[12:15]) and len(held.parts) == 1
    assert held.since(15).shape == (0, 2)  # nothing new since
    held.add(rows[17:18], 18, 18)  # a gap (positions 15-16 never came): only what follows it is held
    assert torch.equal(held.since(0), rows[17:18])


def test_a_prompts_forward_is_not_taken_for_a_verifys():
    """The round that carries the prompt reports its forward (here: most of the prompt found in a prefix
    cache, so a few rows ran, quickly); verify rounds alone feed T(rows): priced from that forward, every
    verify up to the prompt's length looked as cheap as one step and drafting looked free."""
    class CachedPromptScorer(FakeScorer):
        async def score(self, call):
            scores = await super().score(call)
            n = len(call.new_ids)
            seconds = 0.010 if n > call.num_positions else 0.010 * (1 + 0.25 * (n - 1))  # the prompt: 1 row ran
            return Scores(scores.greedy_tokens, None, forward=ForwardStats(n, 1, seconds))

    prompt = list(range(3, 40))
    costs = CostModel()
    rounds = run(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=8), FakeProposer(agree_every=2),
                 CachedPromptScorer(), DraftLengthPolicy(3, costs, "ngram", adaptive=False), Stats())
    assert [tok for rnd in rounds for tok in rnd.new_tokens] == reference_greedy(prompt, 8)
    assert set(costs.forward_s) <= {1, 2, 3, 4} and costs.forward_s[4].value == pytest.approx(0.0175)


def test_a_sequences_first_draft_call_prefills_and_is_not_priced_as_a_round():
    """The first draft call of a sequence carries its prompt (here 50 ms of it): its time is not a round's
    draft cost, or one prefill would price every round's draft at many steps and stop drafting."""
    import time

    class PrefillingProposer(FakeProposer):
        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
            if keep == 0:
                time.sleep(0.05)
            return await super().propose(seq_id, keep, new_ids, k, params, round_seed, reserve)

    costs, seen = CostModel(), []
    observe = costs.observe_draft
    costs.observe_draft = lambda method, tokens, seconds, forward=None: seen.append(seconds) or observe(method, tokens, seconds, forward)
    policy = DraftLengthPolicy(3, costs, "fake", adaptive=False)
    stats = Stats()
    run(GenerationRequest(seq_id=1, prompt_ids=[3, 1, 4, 1, 5], max_tokens=40), PrefillingProposer(), FakeScorer(),
        policy, stats)
    assert len(seen) == stats.rounds - 1 and max(seen) < 0.025  # the rounds' calls only: never the prefill's


def test_a_draft_call_after_paused_rounds_catches_up_and_is_not_priced_as_a_round():
    """Rounds that drafted nothing leave the draft's cache behind; the next call appends them all and takes
    longer (here 50 ms for more than two new tokens): it is not a round's draft cost, and the stops of a
    draft asked for more than it drafted are counted (reach)."""
    import time

    class CatchingUpProposer(FakeProposer):
        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
            if keep and len(new_ids) > 3:
                time.sleep(0.05)
            proposal = await super().propose(seq_id, keep, new_ids, k, params, round_seed, reserve)
            return Proposal(proposal.tokens[:2], None, proposal.cached_length)  # a stop after two tokens

    class PausingPolicy(DraftLengthPolicy):
        rounds = 0

        def next_k(self):
            self.rounds += 1
            return 0 if self.rounds % 6 in (1, 2, 3) else 4  # three paused rounds, three drafting ones

    costs, seen = CostModel(), []
    observe = costs.observe_draft
    costs.observe_draft = lambda method, tokens, seconds, forward=None: seen.append(seconds) or observe(method, tokens, seconds, forward)
    policy = PausingPolicy(4, costs, "fake")
    prompt = [3, 1, 4, 1, 5]
    rounds = run(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=40), CatchingUpProposer(), FakeScorer(),
                 policy)
    assert [tok for rnd in rounds for tok in rnd.new_tokens] == reference_greedy(prompt, 40)
    assert seen and max(seen) < 0.025  # the steady calls only: those that follow a drafting round
    # Asked 4, drafted 2 every time: the first two positions always drafted, the third never
    assert costs.reach("fake", 4)[:2] == [1.0, 1.0] and costs.reach("fake", 4)[2] < 0.2
