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
    assert (ahead.start, ahead.token) == (4, int(result[1][-1]))
    (taken,) = run(target, [Step(1, 4, [ahead.token], 1)])
    assert 1 in target.lm.ahead_taken and target.lm.ahead_used == 1
    assert torch.allclose(taken[0], dynamic_executor(tiny_lm).extend(9, 0, [5, 6, 7, 4, ahead.token], 1), atol=1e-10)
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
