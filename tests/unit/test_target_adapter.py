"""target_model's step results: each request's greedy tokens, copied to the host once per execution."""

import numpy as np
import pytest
import torch

from specdec.engine.build import dynamic_executor
from specdec.engine.executor import CacheError, Step
from specdec.triton.language_models import TargetModel

from .conftest import FakeTensor


def test_one_execution_answers_each_step_with_its_own_tokens_and_errors_in_place(tiny_lm):
    adapter = TargetModel.__new__(TargetModel)  # the step logic only: no Triton stub here
    adapter.lm = dynamic_executor(tiny_lm)
    steps = [Step(1, 0, [5, 6, 7], 3), Step(2, 4, [1], 1),  # sequence 2 has no cache: an error
             Step(3, 0, [9, 8], 1), Step(4, 0, [2], 0)]
    results = adapter._gather(steps, adapter._run(steps))
    assert isinstance(results[1], CacheError)
    solo = dynamic_executor(tiny_lm)
    for step, result in zip(steps, results):
        if step.seq_id == 2:
            continue
        logits, tokens, features, scored = result
        assert features is None and scored is None  # no head served: no hidden_layers; no prompt scored
        expected = solo.extend(step.seq_id, 0, step.new_ids, step.num_logits)
        assert torch.allclose(logits, expected, atol=1e-10, rtol=0)  # float64: one packed forward vs one alone
        assert tokens.dtype == np.int32 and tokens.tolist() == expected.argmax(-1).tolist()
        assert tokens.tolist() == logits.argmax(-1).tolist()
        assert len(tokens) == step.num_logits


def test_a_prompt_to_score_has_its_score_rows_split_off_before_the_verified_positions(tiny_lm):
    """A step with score_rows runs every row's logits; the first score_rows are the prompt's (scored on the
    target's side from all of them, sampling.scored_rows), the rest the positions it verifies, whose greedy
    tokens (among the allowed) are picked."""
    adapter = TargetModel.__new__(TargetModel)
    adapter.lm = dynamic_executor(tiny_lm)
    bits = torch.zeros(2, (tiny_lm.config.vocab_size + 31) // 32, dtype=torch.int32)
    bits[:, 0] = 0b100  # token 2 only
    steps = [Step(1, 0, [5, 6, 7, 8, 9], 5, score_rows=3, allowed=bits), Step(2, 0, [5, 6, 7, 8, 9], 5)]
    (logits, tokens, _, rows), (whole, _, _, none) = adapter._gather(steps, adapter._run(steps))
    assert none is None and rows.shape[0] == 5 and logits.shape[0] == 2 and tokens.tolist() == [2, 2]
    torch.testing.assert_close(rows, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits, rows[3:], rtol=0, atol=0)


def test_an_execution_of_errors_only_returns_the_errors(tiny_lm):
    adapter = TargetModel.__new__(TargetModel)
    adapter.lm = dynamic_executor(tiny_lm)
    steps = [Step(1, 2, [5], 1)]
    (result,) = adapter._gather(steps, adapter._run(steps))
    with pytest.raises(CacheError, match="has no cache"):
        raise result


_Tensor = FakeTensor


class _Request:
    """The two calls of pb_utils' InferenceRequest that parsing makes, counting the listings."""

    def __init__(self, **inputs):
        self._inputs = [_Tensor(name, value) for name, value in inputs.items()]
        self.listed = 0

    def inputs(self):
        self.listed += 1
        return list(self._inputs)


def test_a_step_is_parsed_from_one_listing_of_the_requests_inputs():
    from specdec import tensor_names as tn
    from specdec.triton.language_models import DraftModel, _inputs

    request = _Request(**{tn.INPUT_IDS: [[4, 5, 6]], tn.CACHE_LENGTH: [[7]], tn.NUM_LOGITS: [[3]]})
    step = TargetModel.__new__(TargetModel)._parse_step(_inputs(request), 11)
    assert (step.seq_id, step.keep, step.new_ids, step.num_logits) == (11, 7, [4, 5, 6], 3)
    assert request.listed == 1
    bare = TargetModel.__new__(TargetModel)._parse_step(_inputs(_Request(**{tn.INPUT_IDS: [[1]]})), 2)
    assert (bare.keep, bare.num_logits) == (0, 1)  # the optional inputs' defaults
    draft = DraftModel.__new__(DraftModel)
    draft.lm = type("LM", (), {"logits_device": torch.device("cpu")})()
    request = _Request(**{tn.INPUT_IDS: [[1, 2]], tn.CACHE_LENGTH: [[0]], tn.NUM_DRAFT_TOKENS: [[5]],
                          tn.TEMPERATURE: [[0.7]], tn.TOP_K: [[20]], tn.TOP_P: [[0.9]], tn.MIN_P: [[0.1]],
                          tn.SEED: [[3]]})
    step = draft._parse_step(_inputs(request), 1)
    assert step.k == 5 and step.params.temperature == pytest.approx(0.7) and step.params.top_k == 20
    assert step.params.min_p == pytest.approx(0.1)
    assert step.generator is not None and request.listed == 1
    with pytest.raises(ValueError, match=tn.INPUT_IDS):
        TargetModel.__new__(TargetModel)._parse_step(_inputs(_Request(**{tn.CACHE_LENGTH: [[0]]})), 1)


def test_a_step_with_an_allowed_tokens_bitmask_gets_the_best_allowed_tokens(tiny_lm):
    """The grammar's bitmask, sent with a verify, picks among the allowed tokens where the logits are; the
    other steps of the execution keep their plain argmax. A bitmask of the wrong shape is refused by name."""
    from specdec import tensor_names as tn

    adapter = TargetModel.__new__(TargetModel)
    adapter.lm = dynamic_executor(tiny_lm)
    vocab = tiny_lm.config.vocab_size
    words = (vocab + 31) // 32
    bits = torch.zeros(3, words, dtype=torch.int32)
    bits[:, 0] = 0b1010  # tokens 1 and 3 only
    bits[2, 0] = -1  # the last position: tokens 0-31
    steps = [Step(1, 0, [5, 6, 7], 3, allowed=bits), Step(2, 0, [5, 6, 7], 3)]
    (masked_logits, masked, *_), (plain_logits, plain, *_) = adapter._gather(steps, adapter._run(steps))
    # The bitmask picks; it leaves the logits alone (equal up to rounding: a batched forward's rows may
    # round differently, as on an AMD EPYC host's AVX-512 kernels).
    torch.testing.assert_close(masked_logits, plain_logits, rtol=0, atol=1e-12)
    assert plain.tolist() == plain_logits.argmax(-1).tolist()
    expected = [int(masked_logits[0, [1, 3]].argmax()) * 2 + 1, int(masked_logits[1, [1, 3]].argmax()) * 2 + 1,
                int(masked_logits[2, :32].argmax())]
    assert masked.tolist() == expected and masked.tolist() != plain.tolist()

    parse = TargetModel.__new__(TargetModel)._step_options
    options = parse(_inputs_of(**{tn.NUM_LOGITS: [[3]], tn.ALLOWED_TOKENS: bits.numpy()[None]}))
    assert options["num_logits"] == 3 and torch.equal(options["allowed"], bits)
    assert parse(_inputs_of(**{tn.NUM_LOGITS: [[3]]}))["allowed"] is None
    empty = np.zeros((1, 0, 0), dtype=np.int32)  # what the orchestrator sends unguided steps
    assert parse(_inputs_of(**{tn.NUM_LOGITS: [[3]], tn.ALLOWED_TOKENS: empty}))["allowed"] is None
    for wrong in (bits.numpy()[None, :2], bits.numpy(), bits.numpy()[None, :, :1].repeat(2, 0)):
        with pytest.raises(ValueError, match=tn.ALLOWED_TOKENS):
            parse(_inputs_of(**{tn.NUM_LOGITS: [[3]], tn.ALLOWED_TOKENS: wrong}))


def _inputs_of(**inputs):
    from specdec.triton.language_models import _inputs

    return _inputs(_Request(**inputs))


def test_execute_profile_is_off_without_its_variable_and_writes_pstats_with_it(tmp_path, monkeypatch):
    import pstats

    from specdec.triton import profiling

    monkeypatch.delenv(profiling.ENV, raising=False)
    assert profiling.execute_profile("target_model") is None
    monkeypatch.setenv(profiling.ENV, str(tmp_path / "p"))
    profile = profiling.execute_profile("target_model")

    def work():
        return sum(range(1000))

    with profile:
        work()
    work()  # outside: not profiled
    profile.write()
    stats = pstats.Stats(str(profile.path)).stats
    calls = {name: value[1] for (_, _, name), value in stats.items()}
    assert profile.path.name.startswith("target_model-") and calls["work"] == 1


def test_a_hosted_head_drafts_in_the_verify_step_and_its_proposal_waits_for_the_response(tiny_lm):
    """hosted_heads: a step naming a hosted head (tn.DRAFT_HEAD, tn.DRAFT_ASK) has it draft first; the forward
    verifies the proposal after the step's new tokens (its logits' rows count them); the proposal and the
    head's execution wait, by sequence, for the response; the forward's cost leaves the drafting out. A name
    it does not host is refused naming the input; a step without one runs as before, in the same forward."""
    from specdec import tensor_names as tn
    from specdec.decoding.interfaces import DraftAsk
    from specdec.engine.draft_heads import EAGLE3
    from specdec.engine.head_executor import HeadExecutor
    from specdec.engine.hosted_heads import HostedHeads
    from specdec.triton import wire

    from .test_draft_heads import head_for

    head = head_for(tiny_lm, EAGLE3)
    adapter = TargetModel.__new__(TargetModel)
    adapter.lm = dynamic_executor(tiny_lm, hidden_layers=head.config.feature_layers(2))
    adapter.hosted, adapter._drafted = HostedHeads({"eagle3": HeadExecutor(head)}, {"eagle3": None}), {}

    def parsed(seq_id, keep, ids, draft):
        inputs = {**wire.StepMessage(keep, ids).encode(), **wire.VerifyMessage(1, draft=draft).encode()}
        return adapter._parse_step(inputs, seq_id)
    with pytest.raises(ValueError, match=f"input '{tn.DRAFT_HEAD}': no hosted head 'other'"):
        parsed(1, 0, [5, 6], DraftAsk("other", 3))
    first = [parsed(1, 0, [5, 6, 7, 8, 9], DraftAsk("eagle3", 3)), parsed(2, 0, [4, 3], None)]
    assert first[0].draft_head == "eagle3" and first[0].k == 3 and first[0].whole and not first[1].draft_head
    adapter._gather(first, adapter._run(first))
    assert adapter._drafted[1][0].tokens == []  # a first round: no features yet
    steps = [parsed(1, 5, [10], DraftAsk("eagle3", 3)), parsed(2, 2, [1], None)]
    results = adapter._gather(steps, adapter._run(steps))
    drafted, stats = adapter._drafted.pop(1)
    assert len(drafted.tokens) == 3 and stats.sequences == 1 and adapter.side_seconds > 0
    assert results[0][0].shape[0] == 4 and results[1][0].shape[0] == 1  # the proposal verified after [10]
    solo = dynamic_executor(tiny_lm)
    expected = solo.extend(1, 0, [5, 6, 7, 8, 9, 10] + drafted.tokens, 4)
    assert torch.allclose(results[0][0], expected, atol=1e-10, rtol=0)
