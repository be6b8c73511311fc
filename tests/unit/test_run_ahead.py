"""Greedy steps run ahead of their requests (engine/run_ahead.py): a request that asks for the step run ahead
gets exactly the logits its own forward would give; any other request drops it and finds the cache as if
it had never run (float64, both executors, prefix caching on and off); target_model runs one only after a
target-only step that wants nothing but its token, with one sequence live."""

import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import CacheError, Step
from specdec.triton.language_models import ReadyFeatures, TargetModel
from specdec.triton.responder import Job


def executors(model, kind: str, prefix_caching: bool):
    if kind == "dynamic":
        return [dynamic_executor(model, block_size=4, prefix_cache_tokens=256 if prefix_caching else 0)
                for _ in range(2)]
    options = dict(kv_pool_tokens=1024, block_size=4, max_context=256, max_batch=4, max_rows=5, min_window=16,
                   compile="off", prefix_caching=prefix_caching)
    return [static_executor(model, **options) for _ in range(2)]


def ahead_of(lm, seq_id: int, logits: torch.Tensor) -> int:
    """Run the greedy pick of these logits ahead; its value."""
    token = logits[-1].argmax().reshape(1)
    assert lm.run_ahead(seq_id, token, int(token))
    return int(token)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_taken_and_dropped_steps_leave_the_logits_of_a_cache_that_never_ran_ahead(tiny_lm, kind, prefix_caching):
    lm, reference = executors(tiny_lm, kind, prefix_caching)
    prompt = [5, 17, 3, 88, 41, 2, 9, 30, 11]
    # (what the request after each step asks for) "next": the step run ahead; "verify": 3 drafted tokens
    # after it; "rollback": an earlier length; "other": another token at the same length.
    plan = ["next", "next", "verify", "next", "next", "rollback", "next", "other", "next", "next", "next"]
    logits = lm.extend(1, 0, prompt, 1)
    assert torch.equal(logits, reference.extend(1, 0, prompt, 1))
    length, history = len(prompt), list(prompt)
    for ask in plan:
        token = ahead_of(lm, 1, logits)
        if ask == "next":
            step = Step(1, length, [token], 1)
        elif ask == "verify":
            step = Step(1, length, [token, 7, 8, 9], 4)
        elif ask == "rollback":
            length, history = length - 2, history[:-2]
            step = Step(1, length, [13], 1)
        else:
            step = Step(1, length, [(token + 1) % 97], 1)
        (logits,) = lm.extend_many([step])
        (expected,) = reference.extend_many([step])
        assert torch.allclose(logits, expected, atol=1e-12, rtol=0), ask
        taken = ask == "next"
        assert (1 in lm.ahead_taken) == taken, ask
        history += step.new_ids
        length += len(step.new_ids)
        assert lm.cached_length(1) == reference.cached_length(1)
        assert lm.tokens_processed == reference.tokens_processed
    assert (lm.ahead_used, lm.ahead_dropped) == (plan.count("next"), len(plan) - plan.count("next"))
    # The whole history from scratch: the cache that ran ahead holds what a fresh sequence computes.
    fresh = reference.extend(2, 0, history, 1)
    assert torch.allclose(lm.extend(1, length - 1, history[-1:], 1), fresh, atol=1e-10, rtol=0)
    if prefix_caching:  # the blocks of the tokens run ahead are keyed like any: a new prompt finds them
        lm.release(1)
        lm.extend(3, 0, history, 1)
        assert lm.prefix_hit_tokens >= (len(history) - 1) // 4 * 4 - 4


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_round_run_ahead_is_taken_whole_or_in_part_or_dropped_as_if_it_never_ran(tiny_lm, kind, prefix_caching):
    """Executor.run_ahead_step (a hosted head's next round: keep this round's accepted drafts, then the bonus
    token and the next drafts): a step that asks for it, or for a prefix of it (every row's logits are there),
    gets the logits its own forward gives; any other drops it, and the cache is as if it never ran (float64,
    both executors, prefix caching on and off). The features: test_a_hosted_heads_greedy_rounds_run_ahead_*."""
    lm, reference = executors(tiny_lm, kind, prefix_caching)
    prompt = [5, 17, 3, 88, 41, 2, 9, 30, 11]
    lm.extend(1, 0, prompt, 1)
    reference.extend(1, 0, prompt, 1)
    history = list(prompt)
    asks = ["same", "prefix", "last-logits", "longer", "earlier", "other", "same", "prefix"]
    for r, ask in enumerate(asks):
        length = len(history)
        verify = Step(1, length, [3 + r, 40, 41, 42], 4)  # a round: its token and three drafts
        assert torch.allclose(lm.extend_many([verify])[0], reference.extend_many([verify])[0], atol=1e-12, rtol=0)
        history += verify.new_ids
        ran = Step(1, length + 2, [50 + r, 60, 61, 62], 4)  # one draft accepted: the next round, run ahead
        assert lm.run_ahead_step(ran) and not lm.run_ahead_step(ran)  # one pending at most
        step = {"same": ran, "prefix": ran._replace(new_ids=ran.new_ids[:2], num_logits=2),
                "last-logits": ran._replace(new_ids=ran.new_ids[:3], num_logits=1),
                "longer": ran._replace(new_ids=ran.new_ids + [63], num_logits=5),
                "earlier": Step(1, length + 1, [70, 71], 2),
                "other": ran._replace(new_ids=[50 + r, 61], num_logits=2)}[ask]
        (logits,) = lm.extend_many([step])
        (expected,) = reference.extend_many([step])
        assert torch.allclose(logits, expected, atol=1e-12, rtol=0), ask
        assert (1 in lm.ahead_taken) == (ask in ("same", "prefix", "last-logits")), ask
        history = history[:step.keep] + list(step.new_ids)
        assert lm.cached_length(1) == reference.cached_length(1) == len(history)
        assert lm.tokens_processed == reference.tokens_processed
    assert (lm.ahead_used, lm.ahead_dropped) == (5, 3)
    fresh = reference.extend(2, 0, history, 1)  # the cache that ran ahead holds what a fresh sequence computes
    assert torch.allclose(lm.extend(1, len(history) - 1, history[-1:], 1), fresh, atol=1e-10, rtol=0)
    if prefix_caching:  # only confirmed tokens were keyed: a new prompt finds the blocks of the text kept
        lm.release(1)
        lm.extend(3, 0, history, 1)
        assert lm.prefix_hit_tokens >= (len(history) - 1) // 4 * 4 - 8


def test_a_step_run_ahead_is_dropped_by_a_proposal_a_release_and_eviction(tiny_lm):
    lm, _ = executors(tiny_lm, "static", False)
    free = len(lm.kv.pool.free)
    logits = lm.extend(1, 0, [5, 6, 7], 1)
    ahead_of(lm, 1, logits)
    assert lm.cached_length(1) == 4
    lm.propose(1, 3, [9], 2, params=SamplingParams())
    assert 1 not in lm.ahead and lm.ahead_dropped == 1
    ahead_of(lm, 1, lm.extend(1, 4, [2], 1))
    assert lm.release(1) and not lm.ahead and lm.ahead_dropped == 2
    with pytest.raises(CacheError, match="no cache"):
        lm.extend(1, 5, [3], 1)
    assert len(lm.kv.pool.free) == free
    clock = [0.0]
    lm.clock = lambda: clock[0]
    ahead_of(lm, 2, lm.extend(2, 0, [4, 4], 1))
    clock[0] = lm.idle_timeout_s + 1
    assert lm.evict_idle() == [2] and not lm.ahead and lm.ahead_dropped == 3
    # One pending per sequence; none for a sequence that is not there.
    ahead_of(lm, 3, logits := lm.extend(3, 0, [1, 2], 1))
    assert not lm.run_ahead(3, logits[-1].argmax().reshape(1), int(logits[-1].argmax()))
    assert not lm.run_ahead(99, logits[-1].argmax().reshape(1), 0)


class _Request:
    def __init__(self, outputs):
        self.outputs = outputs

    def requested_output_names(self):
        return list(self.outputs)


def adapter(model, run_ahead=True):
    target = TargetModel.__new__(TargetModel)  # the step logic only: no Triton stub here
    target.lm, target.run_ahead = dynamic_executor(model), run_ahead
    return target


def run(target, steps, outputs=(tn.GREEDY_TOKENS, tn.FORWARD_STATS)):
    jobs = [Job(_Request(outputs), step.seq_id, step) for step in steps]
    results = target._gather(steps, target._run(steps))
    outcomes = [(result, None) for result in results]
    target._run_ahead(jobs, outcomes)
    return results


@pytest.mark.parametrize("case", ["target-only", "prompt", "verify", "logits", "log-probs", "all-outputs",
                                  "grammar", "two-live", "off"])
def test_target_model_runs_ahead_only_after_a_target_only_step_that_wants_its_token(tiny_lm, case):
    target = adapter(tiny_lm, run_ahead=case != "off")
    run(target, [Step(1, 0, [5, 6, 7], 1)])
    if case == "two-live":
        run(target, [Step(2, 0, [8], 1)])
    step = {"prompt": Step(1, 3, [4, 4], 1), "verify": Step(1, 3, [4, 4, 4], 3),
            "grammar": Step(1, 3, [4], 1, allowed=torch.full((1, 4), -1, dtype=torch.int32))}.get(case, Step(1, 3, [4], 1))
    outputs = {"logits": (tn.GREEDY_TOKENS, tn.LOGITS), "log-probs": (tn.GREEDY_TOKENS, tn.GREEDY_LOG_PROBS),
               "all-outputs": ()}.get(case, (tn.GREEDY_TOKENS, tn.FORWARD_STATS))
    assert not target.lm.ahead  # a prompt's step is not followed by one
    (result,) = run(target, [step], outputs)
    if case != "target-only":
        assert not target.lm.ahead
        return
    ahead = target.lm.ahead[1]
    assert (ahead.start, ahead.tokens) == (4, (int(result[1][-1]),))
    (taken,) = run(target, [Step(1, 4, list(ahead.tokens), 1)])
    assert 1 in target.lm.ahead_taken and target.lm.ahead_used == 1
    assert torch.allclose(taken[0], dynamic_executor(tiny_lm).extend(9, 0, [5, 6, 7, 4, *ahead.tokens], 1), atol=1e-10)
    assert 1 in target.lm.ahead  # and the next one runs ahead again


class _Tensor:  # pb.Tensor's role: a named host array
    def __init__(self, name, array):
        self.name, self.array = name, array


class _Pb:
    Tensor = _Tensor


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_heads_target_only_step_runs_ahead_and_its_features_are_made_first(tiny_lm, kind):
    """A head's request that drafts nothing asks for its step's features too: its successor still runs ahead
    (2.2 ms a round on an H200 without), the response's features made before it is queued (the response
    does not wait for its forward), and the step taken from it gets the features its own forward gives."""
    layers = (0, 1)
    build = (lambda: dynamic_executor(tiny_lm, hidden_layers=layers)) if kind == "dynamic" else (
        lambda: static_executor(tiny_lm, kv_pool_tokens=1024, block_size=4, max_context=256, max_batch=4, max_rows=5,
                                min_window=16, compile="off", hidden_layers=layers))
    target = TargetModel.__new__(TargetModel)
    target.lm, target.run_ahead, target.pb, target.device_outputs = build(), True, _Pb(), False
    outputs = (tn.GREEDY_TOKENS, tn.FORWARD_STATS, tn.FEATURES)

    def run_features(step):
        job = Job(_Request(outputs), step.seq_id, step)
        outcomes = [(result, None) for result in target._gather([step], target._run([step]))]
        target._run_ahead([job], outcomes)
        (((_, tokens, features, _), _),) = outcomes
        return int(tokens[-1]), features

    text = [5, 6, 7]
    token, _ = run_features(Step(1, 0, text, 1))
    assert not target.lm.ahead  # a prompt's step is not followed by one
    for length in range(3, 7):
        text.append(token)
        token, features = run_features(Step(1, length, [token], 1))
        assert 1 in target.lm.ahead and target.lm.ahead[1].start == length + 1
        assert isinstance(features, ReadyFeatures) and features.tensor.name == tn.FEATURES
        if length > 3:
            assert target.lm.ahead_used == length - 3  # this step was the one run ahead
        # The features the response carries: those of a fresh sequence's forward over the same text
        fresh = build()
        want = fresh.extend_many([Step(2, 0, text, 1)], with_hidden=True)[0].hidden[-1]
        assert torch.allclose(torch.as_tensor(features.tensor.array)[0, -1], want.flatten().float(), atol=1e-5)


def hosted_rounds(tiny_lm, ks, run_ahead, outputs=None, params=SamplingParams(), prepare=None, executors=None):
    """A greedy request's rounds through target_model with a hosted EAGLE-3 head, decided from the greedy picks
    as the orchestrator decides them (accept the drafts they agree with, then the pick after them), K per
    round from `ks` (0: a round that drafts nothing). executors: (the target's, the head's) (default: the
    dynamic executor and the eager head over tiny_lm). Returns (the text, each round's proposal, the adapter)."""
    from specdec.engine.draft_heads import EAGLE3
    from specdec.engine.head_executor import HeadExecutor
    from specdec.engine.hosted_heads import HostedHeads
    from tests.unit.test_draft_heads import PROMPT, head_for
    if executors is None:
        head = head_for(tiny_lm, EAGLE3)
        executors = dynamic_executor(tiny_lm, hidden_layers=head.config.feature_layers(2)), HeadExecutor(head)
    target = TargetModel.__new__(TargetModel)
    target.lm, head = executors
    target.run_ahead, target.side_seconds = run_ahead, 0.0
    target.hosted = HostedHeads({"head": head}, {"head": None})
    target._drafted, target._hosted_ahead, target._ahead_pause = {}, {}, {}
    outputs = outputs or (tn.GREEDY_TOKENS, tn.FORWARD_STATS, tn.DRAFT_TOKENS, tn.DRAFT_PARENTS, tn.DRAFT_STATS)
    if prepare is not None:
        prepare(target)
    text, keep, new, proposals = list(PROMPT), 0, list(PROMPT), []
    for k in ks:
        step = Step(1, keep, new, 1, k=k, params=params, draft_head="head", whole=True)
        (result,) = run(target, [step], outputs)
        drafted = target._drafted.pop(1)[0].tokens if 1 in target._drafted else []  # as the response takes it
        picks = [int(token) for token in result[1]]
        accepted = 0
        while accepted < len(drafted) and picks[accepted] == drafted[accepted]:
            accepted += 1
        proposals.append(list(drafted))
        keep = keep + len(new) + accepted
        text = text[:keep - accepted] + drafted[:accepted] + [picks[accepted]]
        new = [picks[accepted]]
    return text, proposals, target


@pytest.mark.parametrize("stop_below", [0.0, 0.05])
def test_a_hosted_heads_greedy_rounds_run_ahead_and_draft_and_verify_what_they_would_have(tiny_lm, stop_below):
    """target_model with a hosted head and run_ahead on: after each greedy chain round it drafts and verifies the
    next one (its keep and token from the round's picks, this round's K). A round asking for as many drafts
    or fewer takes it (cut to its K); one asking for more, or none, drops it, the head's side put back. Every
    round's proposal and the text are those of the same rounds run without it (float64), which are target-only's."""
    ks = [3, 3, 3, 2, 3, 1, 4, 0, 3, 3, 2, 2, 3]

    def stop(target):  # the confidence stop (served: 0.3): chains that end before K, cut where they would
        target.hosted.heads["head"].stop_below = stop_below
    text, proposals, target = hosted_rounds(tiny_lm, ks, run_ahead=True, prepare=stop)
    plain_text, plain_proposals, plain = hosted_rounds(tiny_lm, ks, run_ahead=False, prepare=stop)
    assert (text, proposals) == (plain_text, plain_proposals)
    assert sum(map(len, proposals)) > 10 and not plain.lm.ahead_used
    assert any(0 < len(drafted) < k for drafted, k in zip(proposals, ks)) == (stop_below > 0)
    # a larger K drops it (and the next round after each runs none ahead), but where the chain it ran ended
    # before its K: a larger K drafts the same
    assert target.lm.ahead_used >= 4 and (target.lm.ahead_dropped >= 1) == (stop_below == 0)
    reference = dynamic_executor(tiny_lm)
    assert text[-1] == int(reference.extend(1, 0, text[:-1], 1)[-1].argmax())  # the last pick is target-only's
    target.hosted.release(1)
    assert not target.hosted.sequences


@pytest.mark.parametrize("case", ["log-probs", "features", "logits"])
def test_a_hosted_round_runs_ahead_only_where_the_picks_decide_the_next_call(tiny_lm, case):
    """A round that asks for more than the picks and the proposal (log-probabilities, features, logits: a
    sampled request's, or logits edited by penalties or a grammar) may be decided otherwise: none runs ahead."""
    outputs = {"log-probs": (tn.GREEDY_TOKENS, tn.GREEDY_LOG_PROBS, tn.DRAFT_TOKENS),
               "features": (tn.GREEDY_TOKENS, tn.FEATURES, tn.DRAFT_TOKENS),
               "logits": (tn.GREEDY_TOKENS, tn.LOGITS, tn.DRAFT_TOKENS)}[case]
    _, proposals, target = hosted_rounds(tiny_lm, [3, 3, 3], run_ahead=True, outputs=outputs)
    assert sum(map(len, proposals)) > 0 and not target.lm.ahead_used and not target._hosted_ahead


def test_a_hosted_round_run_ahead_that_fails_leaves_the_next_call_to_run_its_own(tiny_lm):
    warnings = []

    def broken(target):
        def run_ahead_step(step):
            target.lm._acquire_all([step], target.lm._extend_problem)  # the rollback done, then the forward fails
            raise RuntimeError("planted")
        target.lm.run_ahead_step = run_ahead_step
        target.pb = type("Pb", (), {"Logger": type("Logger", (), {"log_warn": staticmethod(warnings.append)})})
        target.name = "target_model"
    ks = [3, 3, 2, 3]
    text, proposals, target = hosted_rounds(tiny_lm, ks, run_ahead=True, prepare=broken)
    assert (text, proposals) == hosted_rounds(tiny_lm, ks, run_ahead=False)[:2]
    # every round but the first (it drafts none: no features yet)
    assert len(warnings) == len(ks) - 1 and "planted" in warnings[0] and not target._hosted_ahead


def test_a_sequence_whose_rounds_run_ahead_are_dropped_runs_fewer(tiny_lm):
    """A drop costs a GPU the rest of a forward: after one, a sequence's next round runs none ahead, after
    another two, then 4, at most 8; a round taken clears it. A round that drafts nothing takes the first row
    of one run ahead (no drop); one asking for more drafts drops it."""
    ks = [3, 3] + [2, 3] * 12
    text, proposals, target = hosted_rounds(tiny_lm, ks, run_ahead=True)
    assert (text, proposals) == hosted_rounds(tiny_lm, ks, run_ahead=False)[:2]
    # Run ahead after a K=3 round: the next (K=2) takes it, cut; after a K=2 one: the next drops it. Unpaused,
    # 12 and 12; paused: after rounds 2 (taken), 3 (dropped: the next round runs none), 5 (dropped: the next
    # two none), 8 (taken: cleared), 9, 11, 14, 15, 17, 20, 21, 23
    assert (target.lm.ahead_used, target.lm.ahead_dropped) == (4, 8)
    paused = [3] + [3, 0] * 6  # the policy pausing every other round (K=0): each takes the bonus token's row
    text, _, target = hosted_rounds(tiny_lm, paused, run_ahead=True)
    assert (target.lm.ahead_used, target.lm.ahead_dropped) == (6, 0)
    assert text == hosted_rounds(tiny_lm, paused, run_ahead=False)[0]
