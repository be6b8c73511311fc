"""vLLM's backend's additional outputs: their names, shapes and meanings, without a server."""

import json

import numpy as np
import pytest

from specdec import tensor_names as tn
from specdec.triton.vllm_outputs import NOT_FINISHED, additional_outputs, logprobs_json


def _text(token: int) -> str:
    return f"<{token}>"


def test_logprobs_hold_the_generated_token_first_then_the_most_likely_each_once():
    entries = json.loads(logprobs_json([7, 3], [-0.5, -2.0], [1, 4], ([[7, 9], [1, 2]], [[-0.5, -1.5], [-0.1, -0.9]]),
                                       _text))
    assert entries == [
        {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
         "9": {"logprob": -1.5, "rank": 2, "decoded_token": "<9>"}},
        {"3": {"logprob": -2.0, "rank": 4, "decoded_token": "<3>"},
         "1": {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": "<1>"},
         "2": {"logprob": pytest.approx(-0.9), "rank": 2, "decoded_token": "<2>"}}]
    assert list(entries[1]) == ["3", "1", "2"]  # the generated token's entry first, as vLLM's
    # logprobs 0: the generated token alone; no ranks known: greedy choices, rank 1
    assert json.loads(logprobs_json([5], [-0.25], None, None, _text)) == [
        {"5": {"logprob": -0.25, "rank": 1, "decoded_token": "<5>"}}]
    assert logprobs_json([], [], [], ([], []), _text) == "[]"


def test_each_flag_asks_for_its_output_and_nothing_else():
    assert additional_outputs(frozenset(), ids=[1, 2], finish=None, cumulative=-1.0, logprobs="[]") == {}
    out = additional_outputs(frozenset(tn.VLLM_OUTPUT_FLAGS), ids=[1, 2, 3], finish=None, cumulative=-1.5,
                             logprobs=None)
    assert set(out) == {tn.FINISH_REASON, tn.CUMULATIVE_LOGPROB, tn.LOGPROBS, tn.NUM_OUTPUT_TOKENS}
    assert out[tn.FINISH_REASON].tolist() == [[NOT_FINISHED.encode()]]  # a streamed response before the last
    assert out[tn.CUMULATIVE_LOGPROB].dtype == np.float32 and out[tn.CUMULATIVE_LOGPROB].tolist() == [[-1.5]]
    assert out[tn.LOGPROBS].tolist() == [[b"null"]]  # no `logprobs` in sampling_parameters
    assert out[tn.NUM_OUTPUT_TOKENS].tolist() == [[3]]  # this response's tokens
    last = additional_outputs(frozenset([tn.RETURN_FINISH_REASON, tn.RETURN_LOGPROBS]), ids=[], finish="length",
                              cumulative=0.0, logprobs="[]")
    assert last[tn.FINISH_REASON].tolist() == [[b"length"]] and last[tn.LOGPROBS].tolist() == [[b"[]"]]


def _request(parameters: str = "", **inputs):
    from specdec.triton.vllm_compatible import VllmRequest

    arrays = {tn.TEXT_INPUT: np.array([b"Hi"], dtype=np.object_),
              **{name: np.array([value]) for name, value in inputs.items()}}
    return VllmRequest.parse(arrays.get, parameters)


def test_vllm_compatible_reads_a_request_as_vllms_backend_does():
    """The prompt comes before the text when not streamed unless exclude_input_in_output (vLLM's default),
    and streaming with it false is refused; the ensemble gets batch-shaped inputs and the flags; the outputs
    are vLLM's, shaped [1] and typed as its backend types them, only those the flags ask for."""
    from specdec.triton.inputs import InputError
    from specdec.triton.vllm_compatible import finished

    whole = _request()
    assert (whole.prompt, whole.stream, whole.prepend, whole.flags, whole.parameters) == ("Hi", False, True,
                                                                                         frozenset(), {})
    assert not _request(exclude_input_in_output=True).prepend and not _request(stream=True).prepend
    with pytest.raises(InputError, match="'exclude_input_in_output' false is not allowed when streaming"):
        _request(stream=True, exclude_input_in_output=False)
    flagged = _request('{"max_tokens": 4}', stream=True, return_logprobs=True, return_num_output_tokens=True,
                       return_finish_reason=False)
    assert flagged.parameters == {"max_tokens": 4} and flagged.settings is None
    arrays = flagged.ensemble_inputs()
    assert set(arrays) == {tn.TEXT_INPUT, tn.STREAM, tn.RETURN_LOGPROBS, tn.RETURN_NUM_OUTPUT_TOKENS}
    assert all(array.shape == (1, 1) for array in arrays.values())
    assert tn.LOGPROBS in flagged.requested_outputs() and tn.CUMULATIVE_LOGPROB not in flagged.requested_outputs()
    got = {tn.TEXT_OUTPUT: np.array([[b" there"]], dtype=np.object_), tn.FINISH_REASON: np.array([[b"None"]], dtype=np.object_),
           tn.NUM_INPUT_TOKENS: np.array([[2]], dtype=np.int32), tn.NUM_OUTPUT_TOKENS: np.array([[1]], dtype=np.int32),
           tn.LOGPROBS: np.array([[b"[]"]], dtype=np.object_), tn.GENERATION_ID: np.array([[5]], dtype=np.uint64)}
    out = flagged.outputs(got)
    assert set(out) == {tn.TEXT_OUTPUT, tn.LOGPROBS, tn.NUM_OUTPUT_TOKENS}
    assert out[tn.TEXT_OUTPUT].tolist() == [b" there"] and out[tn.NUM_OUTPUT_TOKENS].dtype == np.uint32
    assert whole.outputs(got)[tn.TEXT_OUTPUT].tolist() == [b"Hi there"]
    assert not finished(got) and finished({**got, tn.FINISH_REASON: np.array([[b"stop"]], dtype=np.object_)})
    assert not finished({**got, tn.FINISH_REASON: np.array([[b""]], dtype=np.object_)})
