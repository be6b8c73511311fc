"""A trained head hosted in the target's process (engine/hosted_heads.py: it drafts in the verify call, from
features that never leave the process) against the same head called as a draft of its own (the decode
loop hands it the features): the same proposals round by round and the same output, greedy and sampled
(float64), for EAGLE-1 and EAGLE-3 heads, chains and trees, fixed and adaptive K, prompt lookup first;
several sequences in one batch; greedy output equal to target-only."""

import asyncio

import pytest

from specdec.decoding.draft_length import CostModel, DraftLengthPolicy
from specdec.decoding.interfaces import HostedProposer
from specdec.decoding.lookup_first import LookupFirstProposer
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor
from specdec.engine.draft_heads import EAGLE, EAGLE3
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.hosted_heads import HostedHeads
from specdec.engine.local import LocalProposer, LocalScorer

from .test_draft_heads import PROMPT, head_for, reference_greedy

PROMPTS = [PROMPT, [3, 9, 27, 81, 50, 3, 9, 27, 12, 44, 3, 9], [60, 61, 62, 60, 61, 62, 60, 61]]


class Recording:
    """A proposer's proposals, recorded: called (propose's return) or hosted (the verify call's)."""

    def __init__(self, inner):
        self.inner, self.tokens = inner, []
        for name in ("wants_features", "branches", "hosted", "salted", "adapts", "choose", "drafted_in_verify"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    async def propose(self, *args, **kwargs):
        proposal = await self.inner.propose(*args, **kwargs)
        if proposal.ask is None:
            self.tokens.append((proposal.tokens, proposal.parents))
        return proposal

    async def release(self, seq_id):
        await self.inner.release(seq_id)


class RecordingScorer:
    def __init__(self, inner, recording):
        self.inner, self.recording = inner, recording

    async def score(self, call):
        scores = await self.inner.score(call)
        if scores.proposal is not None and call.draft.k:
            self.recording.tokens.append((scores.proposal.tokens, scores.proposal.parents))
        return scores

    async def release(self, seq_id):
        await self.inner.release(seq_id)


def run_both(tiny_lm, kind, params, k, branches=1, adaptive=False, lookup_first=False, prompts=(PROMPT,)):
    """(called, hosted): each side's outputs (per prompt) and proposals, the prompts run concurrently."""
    head = head_for(tiny_lm, kind)
    layers = head.config.feature_layers(tiny_lm.config.num_hidden_layers)
    sides = []
    for hosted in (False, True):
        target = dynamic_executor(tiny_lm, hidden_layers=layers)
        executor = HeadExecutor(head)
        executor.stop_below = 0.05  # the confidence stop, as served
        if hosted:
            proposer = HostedProposer("head", branches)
            scorer = LocalScorer(target, HostedHeads({"head": executor}, {"head": None}))
        else:
            proposer, scorer = LocalProposer(executor, branches), LocalScorer(target)
        if lookup_first:
            proposer = LookupFirstProposer(NgramProposer(), proposer)
        recording = Recording(proposer)
        scorer = RecordingScorer(scorer, recording)
        costs = CostModel()

        async def run():
            async def one(seq_id, prompt):
                policy = DraftLengthPolicy(k, costs, "head", adaptive=adaptive, branches=branches) if adaptive \
                    else DraftLengthPolicy.fixed(k, branches=branches)
                req = GenerationRequest(seq_id=seq_id, prompt_ids=prompt, max_tokens=24, sampling=params)
                return [t async for rnd in generate(req, recording, scorer, policy, Stats()) for t in rnd.new_tokens]
            return await asyncio.gather(*(one(10 + i, prompt) for i, prompt in enumerate(prompts)))
        outputs = asyncio.run(run())
        assert not target.sequences and not executor.sequences  # released
        sides.append((outputs, recording.tokens))
    return sides


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
@pytest.mark.parametrize("branches", [1, 3])
def test_a_hosted_head_drafts_what_the_called_head_drafts_greedy(tiny_lm, kind, branches):
    (called, called_drafts), (hosted, hosted_drafts) = run_both(tiny_lm, kind, SamplingParams(), 4, branches,
                                                                prompts=PROMPTS)
    assert hosted == called
    assert hosted[0] == reference_greedy(tiny_lm, PROMPT, 24)
    assert sorted(map(str, hosted_drafts)) == sorted(map(str, called_drafts))  # batched: orders may differ
    assert sum(len(tokens) for tokens, _ in hosted_drafts) > 20
    if branches > 1:
        assert any(parents is not None for _, parents in hosted_drafts)


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_a_hosted_head_samples_what_the_called_head_samples(tiny_lm, kind):
    params = SamplingParams(temperature=0.8, seed=5)
    (called, called_drafts), (hosted, hosted_drafts) = run_both(tiny_lm, kind, params, 3)
    assert hosted == called
    assert hosted_drafts == called_drafts


def test_a_hosted_head_with_prompt_lookup_first(tiny_lm):
    (called, called_drafts), (hosted, hosted_drafts) = run_both(tiny_lm, EAGLE3, SamplingParams(), 6,
                                                                lookup_first=True, prompts=PROMPTS)
    assert hosted == called
    assert hosted_drafts and sorted(map(str, hosted_drafts)) == sorted(map(str, called_drafts))


def test_a_hosted_head_with_adaptive_k(tiny_lm):
    """The policy prices it from the head's reported execution (its choices follow measured times: the
    outputs are compared, not the proposals)."""
    (called, _), (hosted, hosted_drafts) = run_both(tiny_lm, EAGLE3, SamplingParams(), 6, branches=3, adaptive=True,
                                                    lookup_first=True, prompts=PROMPTS)
    assert hosted == called
    assert any(tokens for tokens, _ in hosted_drafts)


def test_a_hosted_head_named_wrongly_fails_the_call_only(tiny_lm):
    head = head_for(tiny_lm, EAGLE3)
    target = dynamic_executor(tiny_lm, hidden_layers=head.config.feature_layers(2))
    scorer = LocalScorer(target, HostedHeads({"head": HeadExecutor(head)}, {"head": None}))

    async def run():
        rounds = generate(GenerationRequest(seq_id=1, prompt_ids=PROMPT, max_tokens=8), HostedProposer("other"),
                          scorer, DraftLengthPolicy.fixed(2))
        return [t async for rnd in rounds for t in rnd.new_tokens]
    with pytest.raises(ValueError, match="no hosted head 'other'"):
        asyncio.run(run())
    assert not target.sequences


def test_a_hosted_head_that_fails_drafts_nothing_and_the_verify_goes_on(tiny_lm):
    head = head_for(tiny_lm, EAGLE3)
    executor = HeadExecutor(head)
    target = dynamic_executor(tiny_lm, hidden_layers=head.config.feature_layers(2))
    hosted = HostedHeads({"head": executor}, {"head": None})
    scorer = LocalScorer(target, hosted)
    calls = []

    def broken(steps):
        calls.append(len(steps))
        raise RuntimeError("planted")
    executor.propose_many = broken

    async def run():
        rounds = generate(GenerationRequest(seq_id=1, prompt_ids=PROMPT, max_tokens=12), HostedProposer("head"),
                          scorer, DraftLengthPolicy.fixed(3))
        return [t async for rnd in rounds for t in rnd.new_tokens]
    assert asyncio.run(run()) == reference_greedy(tiny_lm, PROMPT, 12)
    assert hosted.failures == len(calls) > 5 and "planted" in hosted.last_failure
    totals = hosted.totals["head"]  # what specdec_hosted_head_failures_total reports
    assert (totals.failures, totals.proposals, totals.tokens) == (len(calls), len(calls), 0)


def test_a_hosted_heads_work_is_counted_for_its_metrics(tiny_lm):
    """HostedHeads.totals, by head (target_model's specdec_hosted_head_* metrics): the proposals asked of it,
    the tokens it drafted (what the loop verified), its seconds; a head no request named counts nothing."""
    head = head_for(tiny_lm, EAGLE3)
    target = dynamic_executor(tiny_lm, hidden_layers=head.config.feature_layers(2))
    hosted = HostedHeads({"head": HeadExecutor(head), "idle": HeadExecutor(head_for(tiny_lm, EAGLE3, seed=1))},
                         {"head": None, "idle": None})
    stats = Stats()

    async def run():
        rounds = generate(GenerationRequest(seq_id=1, prompt_ids=PROMPT, max_tokens=16), HostedProposer("head"),
                          LocalScorer(target, hosted), DraftLengthPolicy.fixed(3), stats)
        return [t async for rnd in rounds for t in rnd.new_tokens]
    assert asyncio.run(run()) == reference_greedy(tiny_lm, PROMPT, 16)
    totals, idle = hosted.totals["head"], hosted.totals["idle"]
    assert totals.tokens == stats.drafted > 0 and totals.failures == 0
    assert stats.rounds - 1 <= totals.proposals <= stats.rounds  # every round drafts but the first
    assert totals.seconds > 0 and (idle.proposals, idle.tokens, idle.seconds) == (0, 0, 0.0)
