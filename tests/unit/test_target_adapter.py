"""target_model's step results: each request's greedy tokens, copied to the host once per execution."""

import numpy as np
import pytest
import torch

from specdec.engine.executor import CacheError, CausalLM, Step
from specdec.triton.language_models import TargetModel


def test_one_execution_answers_each_step_with_its_own_tokens_and_errors_in_place(tiny_lm):
    adapter = TargetModel.__new__(TargetModel)  # the step logic only: no Triton stub here
    adapter.lm = CausalLM(tiny_lm)
    steps = [Step(1, 0, [5, 6, 7], 3), Step(2, 4, [1], 1),  # sequence 2 has no cache: an error
             Step(3, 0, [9, 8], 1), Step(4, 0, [2], 0)]
    results = adapter._gather(adapter._run(steps))
    assert isinstance(results[1], CacheError)
    solo = CausalLM(tiny_lm)
    for step, result in zip(steps, results):
        if step.seq_id == 2:
            continue
        logits, tokens = result
        expected = solo.extend(step.seq_id, 0, step.new_ids, step.num_logits)
        assert torch.allclose(logits, expected, atol=1e-10, rtol=0)  # float64: one packed forward vs one alone
        assert tokens.dtype == np.int32 and tokens.tolist() == expected.argmax(-1).tolist()
        assert tokens.tolist() == logits.argmax(-1).tolist()
        assert len(tokens) == step.num_logits


def test_an_execution_of_errors_only_returns_the_errors(tiny_lm):
    adapter = TargetModel.__new__(TargetModel)
    adapter.lm = CausalLM(tiny_lm)
    (result,) = adapter._gather(adapter._run([Step(1, 2, [5], 1)]))
    with pytest.raises(CacheError, match="has no cache"):
        raise result
