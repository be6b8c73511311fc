"""A model's generation_config.json: its end tokens and the OpenAI API's sampling defaults (vLLM's
--generation-config and --override-generation-config), read and refused as the server and the API read them."""

import json

import pytest

from specdec import tensor_names as tn
from specdec.decoding import generation_config as gc
from specdec.gateway import protocol

LLAMA_31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
            "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"}


def write(directory, config) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / gc.FILE).write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(directory)


def test_a_model_directory_or_the_file_itself_is_read_and_a_model_without_one_has_none(tmp_path):
    model = write(tmp_path / "llama", LLAMA_31)
    assert gc.read(model, "f") == gc.read(str(tmp_path / "llama" / gc.FILE), "f") == LLAMA_31
    (tmp_path / "bare").mkdir()
    assert gc.read(str(tmp_path / "bare"), "f") == {}  # models without the file: nothing of it
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert gc.read(str(gguf), "f") == {} and gc.read("", "f") == {}


@pytest.mark.parametrize("text, problem", [("{not json", "cannot read"), ("[1, 2]", "is no JSON object")])
def test_a_file_that_is_no_json_object_is_refused_naming_the_field_and_the_file(tmp_path, text, problem):
    model = write(tmp_path / "m", text)
    with pytest.raises(ValueError, match=rf"^parameter 'generation_config': .*{gc.FILE}.*{problem}|"
                                          rf"^parameter 'generation_config': {problem}"):
        gc.read(model, "parameter 'generation_config'")
    with pytest.raises(ValueError, match="neither a model directory nor"):  # a path that is not there: a typo
        gc.read(str(tmp_path / "missing"), "--generation-config")


def test_every_end_token_the_file_names_is_taken_and_each_checked_against_the_vocabulary():
    assert gc.end_ids(LLAMA_31, 128256, "f") == {128001, 128008, 128009}
    assert gc.end_ids({"eos_token_id": 2}, 49152, "f") == {2}
    assert gc.end_ids({}, 10, "f") == frozenset() and gc.end_ids({"eos_token_id": None}, 10, "f") == frozenset()
    for bad in (128256, -1, True, "2", [1, 2.5]):
        with pytest.raises(ValueError, match=r"^param: eos_token_id .* within \[0, 128256\)"):
            gc.end_ids({"eos_token_id": bad}, 128256, "param")


def test_the_sampling_fields_become_request_defaults_under_the_apis_names_with_the_overrides_over_them():
    qwen3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [151645, 151643],
             "max_new_tokens": 2048, "do_sample": True, "min_p": None}
    assert gc.sampling_defaults(qwen3, {}, "a", "b") == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                          "max_tokens": 2048}
    # the override wins, adds, and a null removes one of the file's (vLLM's merge)
    assert gc.sampling_defaults(qwen3, {"temperature": 0.2, "min_p": 0.05, "max_new_tokens": None}, "a", "b") == {
        "temperature": 0.2, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
    assert gc.sampling_defaults({}, {"repetition_penalty": 1.1}, "a", "b") == {"repetition_penalty": 1.1}


@pytest.mark.parametrize("key, value", [("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0),
                                        ("top_p", 1.5), ("top_k", 2.5), ("top_k", -2), ("min_p", 2),
                                        ("repetition_penalty", 0), ("max_new_tokens", 0), ("temperature", True),
                                        ("temperature", "0.7")])
def test_a_value_no_request_could_send_is_refused_naming_where_it_came_from(key, value):
    with pytest.raises(ValueError, match=rf"^--generation-config: {key} .* is out of range"):
        gc.sampling_defaults({key: value}, {}, "--generation-config", "--override-generation-config")
    with pytest.raises(ValueError, match=rf"^--override-generation-config: {key} .* is out of range"):
        gc.sampling_defaults({}, {key: value}, "--generation-config", "--override-generation-config")


def test_an_override_of_no_sampling_key_or_no_json_object_is_refused_by_name():
    with pytest.raises(ValueError, match="^--override-generation-config: 'temp' is no sampling default"):
        gc.api_defaults(gc.VLLM, "", '{"temp": 0.5}')
    with pytest.raises(ValueError, match="^--override-generation-config: not JSON"):
        gc.api_defaults(gc.VLLM, "", "{temperature: 0.5}")
    with pytest.raises(ValueError, match="^--override-generation-config: must be a JSON object"):
        gc.api_defaults(gc.VLLM, "", "[0.5]")


def test_auto_reads_the_models_file_vllm_none_of_it_and_a_directory_its_own(tmp_path):
    model = write(tmp_path / "llama", LLAMA_31)
    other = write(tmp_path / "other", {"temperature": 0.3})
    assert gc.api_defaults(gc.AUTO, model, "") == {"temperature": 0.6, "top_p": 0.9}
    assert gc.api_defaults(gc.VLLM, model, "") == {}
    assert gc.api_defaults(gc.VLLM, model, '{"top_k": 5}') == {"top_k": 5}  # overrides apply to vllm's too
    assert gc.api_defaults(other, model, '{"max_new_tokens": 7}') == {"temperature": 0.3, "max_tokens": 7}
    with pytest.raises(ValueError, match="^--generation-config: "):
        gc.api_defaults(str(tmp_path / "nowhere"), model, "")


def sent(generation) -> list[dict]:
    return [json.loads(choice[tn.SAMPLING_PARAMETERS][0, 0].decode()) for choice in generation.choices]


def test_a_request_gets_the_defaults_for_what_it_leaves_out_and_keeps_what_it_sends():
    defaults = {**protocol.DEFAULT_SAMPLING, "temperature": 0.6, "top_k": 20, "max_tokens": 9}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    (plain,) = sent(protocol.parse_chat(chat, ("m",), defaults=defaults))
    assert (plain["temperature"], plain["top_k"], plain["max_tokens"]) == (0.6, 20, 9)
    (own,) = sent(protocol.parse_chat({**chat, "temperature": 0, "top_k": 3, "max_completion_tokens": 4}, ("m",),
                                      defaults=defaults))
    assert (own["temperature"], own["top_k"], own["max_tokens"]) == (0, 3, 4)
    (nulls,) = sent(protocol.parse_chat({**chat, "temperature": None, "top_k": None}, ("m",), defaults=defaults))
    assert (nulls["temperature"], nulls["top_k"]) == (0.6, 20)  # null is unset, as OpenAI's SDKs send it
    completion = protocol.parse_completion({"model": "m", "prompt": ["a", "b"]}, ("m",), defaults)
    assert [(s["temperature"], s["max_tokens"]) for s in sent(completion)] == [(0.6, 9)] * 2
    assert completion.sampling["temperature"] == 0.6
    # without defaults of the model's: OpenAI's (temperature 1), and no max_tokens (the server's default)
    (openai,) = sent(protocol.parse_chat(chat, ("m",)))
    assert openai["temperature"] == protocol.OPENAI_TEMPERATURE and "max_tokens" not in openai and "top_k" not in openai


def test_a_prediction_reaches_the_server_and_its_drafts_are_counted_as_openai_reports_them():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for content in ("def f():\n    return 1", [{"type": "text", "text": "def f():\n"}, {"type": "text", "text": "    return 1"}]):
        (sent,) = sent_of(protocol.parse_chat({**chat, "prediction": {"type": "content", "content": content}}, ("m",)))
        assert sent[tn.PREDICTION] == "def f():\n    return 1"
    for bad, field in (({"type": "text", "content": "x"}, "prediction.type"), ({"type": "content", "content": 3},
                                                                              "prediction.content"), ("x", "prediction")):
        with pytest.raises(protocol.ApiError) as caught:
            protocol.parse_chat({**chat, "prediction": bad}, ("m",))
        assert caught.value.param == field
    stats = [{tn.NUM_INPUT_TOKENS: 5, tn.NUM_OUTPUT_TOKENS: 9, tn.TOTAL_DRAFT_TOKENS: 8, tn.TOTAL_ACCEPTED_DRAFT_TOKENS: 6}]
    usage = protocol.combined_usage(stats, [9], 1, predicted=True)
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2}
    assert "completion_tokens_details" not in protocol.combined_usage(stats, [9], 1)


def sent_of(generation) -> list[dict]:
    return [json.loads(choice[tn.SAMPLING_PARAMETERS][0, 0].decode()) for choice in generation.choices]
