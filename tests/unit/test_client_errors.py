"""The sync and asyncio clients map server answers to the same error types (one mapping, in client.core),
and build results the same way (ResultBuilder)."""

import json

import numpy as np
import pytest

from client.core import (ClientError, GenerationParams, InvalidArgumentError, ModelNotReadyError, ResultBuilder,
                         ServerBusyError, classify_error, classify_http_error, server_url)
from specdec import tensor_names as tn


@pytest.mark.parametrize("status, message, kind", [
    (400, "Request for unknown model: 'ensemble' is not found", ModelNotReadyError),
    (400, "Request for unknown model: 'ensemble' has no available versions", ModelNotReadyError),
    (400, "model 'ensemble' is not ready", ModelNotReadyError),
    (400, "input 'max_tokens' must be within [1, 1024], got 0", InvalidArgumentError),
    (404, "not found", ModelNotReadyError),
    (503, "Server not ready", ModelNotReadyError),
    (503, "speculative_decoding: target_model: KV cache budget full: ... (kv_pool_tokens=128); retry later",
     ServerBusyError),
    (500, "boom", ClientError),
])
def test_http_errors(status, message, kind):
    error = classify_http_error(status, json.dumps({"error": message}))
    assert type(error) is kind and str(error) == message


def test_a_streamed_capacity_refusal_is_busy():
    message = "speculative_decoding: 2 sequences are generating (max_live_sequences); retry later"
    assert type(classify_error(message)) is ServerBusyError
    assert type(classify_error("boom")) is ClientError


def test_http_error_with_a_plain_text_body():
    assert str(classify_http_error(500, "upstream died")) == "upstream died"


def test_the_openai_and_anthropic_apis_errors_are_classified_by_their_message():
    restoring = "speculative_decoding: target_model: a model is being restored, retry"
    openai_body = {"error": {"message": restoring, "type": "server_error", "param": None, "code": None}}
    anthropic_body = {"type": "error", "error": {"type": "overloaded_error", "message": restoring}}
    for body in (openai_body, anthropic_body):
        error = classify_http_error(503, json.dumps(body))
        assert type(error) is ModelNotReadyError and str(error) == restoring
    assert type(classify_http_error(400, json.dumps({"error": {"message": "max_tokens: must be >= 1"}}))) \
        is InvalidArgumentError
    assert str(classify_http_error(500, json.dumps({"error": 3}))) == '{"error": 3}'  # no message: the body


def test_server_url():
    assert server_url(None, "grpc") == "localhost:8001"
    assert server_url(None, "http") == "http://localhost:8000"
    assert server_url("https://x:1", "http") == "https://x:1"
    with pytest.raises(ValueError, match="protocol"):
        server_url(None, "ws")


def test_log_probs_accumulate_over_responses_listed_or_bare():
    """gRPC responses give lists; Triton's HTTP generate endpoint writes a one-token response's value bare."""
    builder = ResultBuilder()
    builder.add({tn.TEXT_OUTPUT: "a", tn.OUTPUT_LOG_PROBS: [-0.5, -1.0], tn.CUM_LOG_PROBS: -1.5})
    builder.add({tn.TEXT_OUTPUT: "b", tn.OUTPUT_LOG_PROBS: -0.25, tn.CUM_LOG_PROBS: -1.75})
    builder.add({tn.TEXT_OUTPUT: "", tn.OUTPUT_LOG_PROBS: [], tn.CUM_LOG_PROBS: -1.75, tn.FINISH_REASON: "length"})
    result = builder.result
    assert (result.text, result.log_probs, result.cum_log_probs) == ("ab", [-0.5, -1.0, -0.25], -1.75)
    assert GenerationParams(return_log_probs=True).tensors("hi", False)[tn.RETURN_LOG_PROBS].tolist() == [[True]]
    assert GenerationParams(return_log_probs=True).json("hi", True)["return_log_probs"] is True
    assert "return_log_probs" not in GenerationParams().json("hi", True)
    budget = GenerationParams(reasoning_parser="openai_gptoss", thinking_token_budget=8)
    assert budget.tensors("hi", False)[tn.THINKING_TOKEN_BUDGET].tolist() == [[8]]
    assert budget.json("hi", True)["thinking_token_budget"] == 8 and "thinking_token_budget" not in GenerationParams().json("hi", True)
    top = GenerationParams(return_log_probs=True, num_top_log_probs=2)
    assert top.tensors("hi", False)[tn.NUM_TOP_LOG_PROBS].tolist() == [[2]] and top.json("hi", True)["num_top_log_probs"] == 2
    rows = ResultBuilder(2)  # Triton's HTTP generate endpoint sends a response's rows flat
    rows.add({tn.OUTPUT_TOP_IDS: [7, 3, 9, 1], tn.OUTPUT_TOP_LOG_PROBS: [-0.1, -2.0, -0.5, -1.5]})
    rows.add({tn.OUTPUT_TOP_IDS: [[4, 5]], tn.OUTPUT_TOP_LOG_PROBS: [[-0.2, -0.3]]})
    assert rows.result.top_ids == [[7, 3], [9, 1], [4, 5]]
    assert rows.result.top_log_probs == [[-0.1, -2.0], [-0.5, -1.5], [-0.2, -0.3]]


def test_word_lists_go_out_as_string_lists_over_grpc_and_http():
    params = GenerationParams(stop_words=("\n\n",), bad_words=(" Paris", "ü"))
    arrays = params.tensors("hi", stream=False)
    assert arrays[tn.BAD_WORDS].tolist() == [[b" Paris", "ü".encode()]] and arrays[tn.STOP_WORDS].tolist() == [[b"\n\n"]]
    body = params.json("hi", stream=False)
    assert body[tn.BAD_WORDS] == [" Paris", "ü"] and body[tn.STOP_WORDS] == ["\n\n"]
    assert tn.BAD_WORDS not in GenerationParams().tensors("hi", stream=False)
    assert tn.BAD_WORDS not in GenerationParams().json("hi", stream=False)


def test_penalties_and_min_p_go_out_as_fp32_scalars_over_grpc_and_json_numbers_over_http():
    params = GenerationParams(repetition_penalty=1.2, frequency_penalty=-0.5, min_p=0.5)
    arrays = params.tensors("hi", stream=False)
    assert arrays[tn.REPETITION_PENALTY].dtype == np.float32 and arrays[tn.REPETITION_PENALTY].tolist() == [[1.2000000476837158]]
    assert arrays[tn.FREQUENCY_PENALTY].tolist() == [[-0.5]] and tn.PRESENCE_PENALTY not in arrays
    assert arrays[tn.MIN_P].dtype == np.float32 and arrays[tn.MIN_P].tolist() == [[0.5]]
    body = params.json("hi", stream=True)
    assert (body[tn.REPETITION_PENALTY], body[tn.FREQUENCY_PENALTY]) == (1.2, -0.5) and tn.PRESENCE_PENALTY not in body


def test_a_cache_salt_and_return_prompt_ids_go_out_over_grpc_and_http():
    params = GenerationParams(cache_salt="tenant-1", return_prompt_ids=True)
    arrays = params.tensors("hi", stream=False)
    assert arrays[tn.CACHE_SALT].tolist() == [[b"tenant-1"]] and arrays[tn.RETURN_PROMPT_IDS].tolist() == [[True]]
    body = params.json("hi", stream=False)
    assert (body[tn.CACHE_SALT], body[tn.RETURN_PROMPT_IDS]) == ("tenant-1", True)
    assert tn.CACHE_SALT not in GenerationParams().tensors("hi", stream=False)


def test_a_streamed_http_answers_lines_join_from_any_pieces():
    """SseLines: lines split anywhere (a multi-byte character, CRLF, a megabyte event in many pieces) come out
    whole, each once; a last line without its newline too."""
    from client.sync import SseLines, sse_lines

    event = "data: " + json.dumps({"text_output": "é" * 3, "generation_logits": [0.5] * 200_000})
    body = (event + "\r\n\r\n" + "data: {}\n" + ": keep-alive").encode()
    for size in (1, 7, 4096, 1 << 16, len(body)):
        pieces = [body[i:i + size] for i in range(0, len(body), size)]
        assert list(sse_lines(pieces)) == [event, "", "data: {}", ": keep-alive"], size
    lines = SseLines()
    assert lines.feed(b"data: 1\ndata") == ["data: 1"] and lines.feed(b": 2") == [] and lines.rest() == ["data: 2"]
    assert lines.rest() == []


def test_logits_accumulate_over_responses_flat_or_shaped():
    """generation_logits: each response's rows (its tokens: num_output_tokens counts them all so far), shaped
    (gRPC) or flat (HTTP's generate endpoint); context_logits: the prompt's rows."""
    for flat in (False, True):
        builder = ResultBuilder()
        first = np.arange(2 * 5, dtype=np.float32).reshape(1, 1, 2, 5)
        later = np.arange(100, 105, dtype=np.float32).reshape(1, 1, 1, 5)
        context = np.ones((3, 5), dtype=np.float32)
        for fields in ({tn.NUM_INPUT_TOKENS: 3, tn.NUM_OUTPUT_TOKENS: 2, tn.GENERATION_LOGITS: first,
                        tn.CONTEXT_LOGITS: context},
                       {tn.NUM_OUTPUT_TOKENS: 3, tn.GENERATION_LOGITS: later},
                       {tn.NUM_OUTPUT_TOKENS: 3, tn.GENERATION_LOGITS: np.zeros((1, 1, 0, 0), np.float32)}):
            builder.add({k: (v.reshape(-1).tolist() if flat and isinstance(v, np.ndarray) else v)
                         for k, v in fields.items()})
        result = builder.result
        assert result.generation_logits.shape == (3, 5)
        assert result.generation_logits[2].tolist() == later.reshape(-1).tolist()
        assert result.generation_logits[:2].reshape(-1).tolist() == list(range(10))
        assert result.context_logits.shape == (3, 5) and result.context_logits.flags.writeable
