"""A failing draft model: the request finishes target-only with the same greedy output; the draft is out
of rotation for a while, doubling while it keeps failing, and back after it answers. A draft without room
for one sequence keeps serving the others."""

import asyncio

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.interfaces import NoCapacity
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.sampling import SamplingParams
from specdec.triton.fallback import FallbackProposer

from .test_loop import FakeProposer, FakeScorer, reference_greedy


class FlakyProposer(FakeProposer):
    """Answers except on the calls listed in `fail_on` (1-based)."""

    def __init__(self, fail_on):
        super().__init__(agree_every=3)
        self.fail_on, self.asked = set(fail_on), 0

    async def propose(self, *args, **kwargs):
        self.asked += 1
        if self.asked in self.fail_on:
            raise RuntimeError("draft_model: too many live sequences (1); retry later")
        return await super().propose(*args, **kwargs)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(req, proposer, stats=None):
    async def collect():
        return [t async for rnd in generate(req, proposer, FakeScorer(), DraftLengthPolicy.fixed(3), stats)
                for t in rnd.new_tokens]

    return asyncio.run(collect())


def test_a_failing_draft_falls_back_to_target_only_with_the_same_output():
    prompt = [3, 1, 4, 1, 5]
    req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=30)
    failed = []
    inner = FlakyProposer(fail_on={2})
    clock = Clock()
    proposer = FallbackProposer(inner, "draft_model", failed.append, retry_after_s=5.0, clock=clock)
    stats = Stats()
    assert run(req, proposer, stats) == reference_greedy(prompt, 30)
    assert failed and set(failed) == {"draft_model"}  # the failing round and every round while out
    assert not proposer.available and inner.released == [1, 1]  # dropped after the failure, and at the end
    assert inner.asked == 2  # out of rotation: never called again during this (instant) request
    clock.now = 5.0  # the wait is over: the next request drafts again
    again = Stats()
    assert run(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=30), proposer, again) == \
        reference_greedy(prompt, 30)
    assert again.drafted > 0 and proposer.available


def test_the_wait_doubles_while_the_draft_keeps_failing_and_resets_when_it_answers():
    clock = Clock()
    inner = FlakyProposer(fail_on={1, 2, 3})
    proposer = FallbackProposer(inner, "d", retry_after_s=1.0, max_retry_after_s=3.0, clock=clock)
    params = SamplingParams()

    def propose():
        return asyncio.run(proposer.propose(1, 0, [1, 2], 2, params, 0))

    waits = []
    for _ in range(3):
        assert propose().tokens == []
        waits.append(proposer.out_until - clock.now)
        clock.now = proposer.out_until
    assert waits == [1.0, 2.0, 3.0]  # doubling, capped
    assert propose().tokens  # the 4th call answers
    assert proposer.wait == 1.0 and proposer.available


def test_a_failing_release_does_not_propagate_and_the_targets_cache_is_still_released(capsys):
    class BadRelease(FakeProposer):
        async def release(self, seq_id):
            self.released.append(seq_id)
            raise RuntimeError("gone")

    inner, scorer = BadRelease(agree_every=3), FakeScorer()
    proposer = FallbackProposer(inner, "d")
    prompt = [1, 2, 3, 1, 2]

    async def collect():
        rounds = generate(GenerationRequest(seq_id=7, prompt_ids=prompt, max_tokens=12), proposer, scorer,
                          DraftLengthPolicy.fixed(3))
        return [t async for rnd in rounds for t in rnd.new_tokens]

    assert asyncio.run(collect()) == reference_greedy(prompt, 12)  # the request completes, same output
    assert inner.released == [7] and scorer.released == [7]  # the draft was asked; the target freed anyway
    assert "releasing sequence 7 failed: gone" in capsys.readouterr().err  # logged, not raised


def test_a_draft_without_room_for_a_sequence_stays_in_rotation_for_the_others():
    class Roomless(FakeProposer):
        asked = 0

        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
            self.asked += 1
            if seq_id == 1:
                raise NoCapacity("draft_model: KV cache budget full")
            return await super().propose(seq_id, keep, new_ids, k, params, round_seed, reserve)

        async def release(self, seq_id):
            self.released.append(seq_id)

    clock = Clock()
    inner = Roomless()
    proposer = FallbackProposer(inner, "d", retry_after_s=1.0, clock=clock)
    params = SamplingParams()

    def propose(seq_id, keep=0):
        return asyncio.run(proposer.propose(seq_id, keep, [1, 2], 2, params, 0, reserve=10))

    assert propose(1).tokens == [] and inner.released == [1]  # its sequence at the batcher is ended
    assert proposer.available and propose(2).tokens  # the draft serves other sequences
    assert propose(1).tokens == [] and inner.asked == 2  # sequence 1 is not asked again yet...
    clock.now = 1.0
    assert propose(1).tokens == [] and inner.asked == 3 and inner.released == [1, 1]  # ...until the wait is over
    asyncio.run(proposer.release(1))
    assert 1 not in proposer.no_room_until
