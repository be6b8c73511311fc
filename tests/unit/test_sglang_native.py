"""SGLang's /generate turned into the completions request it stands for, and its answer's pieces
(gateway/sglang_native.py): no server."""

import pytest

from specdec import tensor_names as tn
from specdec.gateway import protocol, sglang_native
from specdec.gateway.protocol import ApiError


def bodies(body: dict):
    return sglang_native.completion_bodies(body, "target")


def test_a_request_becomes_the_completions_body_it_stands_for():
    native, [body] = bodies({"text": "Hi", "rid": "r1", "stream": True, "lora_path": "adapter", "priority": -1,
                             "sampling_params": {"max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.5,
                                                 "top_k": -1, "top_p": 0.9, "no_stop_trim": True, "stop": ["\n"],
                                                 "stop_token_ids": [5], "sampling_seed": 3, "ignore_eos": True,
                                                 "regex": "[a-z]+", "dtype": "float16", "stream_interval": 4}})
    assert body == {"model": "adapter", "stream": True, "priority": -1, "prompt": "Hi", "max_tokens": 7,
                    "min_tokens": 2, "temperature": 0.5, "top_p": 0.9, "include_stop_str_in_output": True,
                    "stop": ["\n"], "stop_token_ids": [5], "seed": 3, "ignore_eos": True, "stream_interval": 4,
                    "structured_outputs": {"regex": "[a-z]+"}, "request_id": "r1"}  # top_k -1: none
    assert not native.batch and native.rids == ["r1"] and native.stops == [["\n"]] and native.stop_ids == [[5]]
    # SGLang's default length, not OpenAI's 16; the completions path reads the body
    native, [body] = bodies({"input_ids": [1, 2, 3]})
    assert body == {"model": "target", "stream": False, "prompt": [1, 2, 3], "max_tokens": 128}
    gen = protocol.parse_completion(body, ("target",))
    assert gen.choices[0][tn.PROMPT_TOKEN_IDS].tolist() == [[1, 2, 3]] and not native.batch


def test_a_batch_shares_one_body_or_gets_one_per_prompt_and_logprobs_map():
    native, [body] = bodies({"text": ["a", "b"], "rid": ["x", "y"], "return_logprob": True, "top_logprobs_num": 2,
                             "logprob_start_len": 0, "sampling_params": {"n": 2}})
    assert body["prompt"] == ["a", "b"] and body["logprobs"] == 2 and body["prompt_logprobs"] == 2
    assert native.batch and native.n == 2 and "request_id" not in body
    assert [native.output_id(i, "g") for i in range(4)] == ["x-0", "x-1", "y-0", "y-1"]
    native, split = bodies({"input_ids": [[1], [2, 3]], "sampling_params": [{"max_new_tokens": 1},
                                                                          {"max_new_tokens": 2}]})
    assert [(b["prompt"], b["max_tokens"]) for b in split] == [([1], 1), ([2, 3], 2)]
    assert native.output_id(1, "g") == "g"
    gens = [protocol.parse_completion(b, ("target",)) for b in split]
    assert [len(g.choices) for g in gens] == [1, 1]


@pytest.mark.parametrize("body, param", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": [[1], "x"]}, "input_ids"),
    ({"text": "a", "image_data": "cat.png"}, "image_data"),
    ({"text": "a", "input_embeds": [[0.1]]}, "input_embeds"),
    ({"text": "a", "custom_logit_processor": "x"}, "custom_logit_processor"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "a", "token_ids_logprob": [1]}, "token_ids_logprob"),
    ({"text": "a", "bootstrap_host": "h"}, "bootstrap_host"),
    ({"text": "a", "no_such": 1}, "no_such"),
    ({"text": "a", "sampling_params": {"no_such": 1}}, "sampling_params.no_such"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params.ebnf"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": []}, "sampling_params"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "stream": True, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"text": "a", "lora_path": ""}, "lora_path"),
])
def test_refusals_name_sglangs_field(body, param):
    with pytest.raises(ApiError) as refused:
        bodies(body)
    assert refused.value.status == 400 and refused.value.param == param


def test_errors_of_the_completions_path_name_the_field_the_client_sent():
    _, [body] = bodies({"text": "a", "sampling_params": {"max_new_tokens": "many"}})
    with pytest.raises(ApiError) as refused:
        protocol.parse_completion(body, ("target",))
    assert sglang_native.renamed(refused.value).param == "sampling_params.max_new_tokens"
    renamed = sglang_native.renamed(protocol.invalid("max_tokens", "max_tokens must be positive"))
    name = "sampling_params.max_new_tokens"
    assert (renamed.param, renamed.message) == (name, f"{name}: {name} must be positive")
    server = protocol.server_error("in ensemble 'ensemble', input 'n' must be positive")
    assert (server.param, server.message) == ("n", "n must be positive")  # the server's words for it left out
    assert sglang_native.renamed(server).message == "sampling_params.n must be positive"
    assert sglang_native.renamed(ApiError(400, "in ensemble 'ensemble', input 'n' must be positive", "n")).message \
        == "in ensemble 'ensemble', input 'sampling_params.n' must be positive"  # the word alone: not in "in"
    bound = protocol.server_error("input 'min_tokens' must be within [0, max_tokens=1], got 2")
    assert sglang_native.renamed(bound).message == ("sampling_params.min_new_tokens must be within "
                                                    "[0, sampling_params.max_new_tokens=1], got 2")
    assert sglang_native.renamed(protocol.invalid("other", "x")).param == "other"


def test_finish_reasons_speculative_figures_and_logprobs_as_sglang_writes_them():
    assert sglang_native.finish_reason("", [1], 1, None) is None
    assert sglang_native.finish_reason("length", [1, 2], 2, None) == {"type": "length", "length": 2}
    assert sglang_native.finish_reason("stop", [1, 2], 2, None) == {"type": "stop", "matched": 2}
    assert sglang_native.finish_reason("stop", [1, 2], 2, "\n") == {"type": "stop", "matched": "\n"}
    stats = {tn.NUM_ROUNDS: 4, tn.TOTAL_DRAFT_TOKENS: 8, tn.TOTAL_ACCEPTED_DRAFT_TOKENS: 6}
    assert sglang_native.spec_info(stats, 10) == {"spec_verify_ct": 4, "spec_accept_length": 2.5,
                                                  "spec_draft_token_num": 8, "spec_accept_token_num": 6,
                                                  "spec_accept_rate": 0.75}
    assert sglang_native.spec_info({}, 10) == {}
    assert sglang_native.token_logprobs([-0.5, -1.0], [7, 8], lambda t: f"<{t}>") == [[-0.5, 7, "<7>"],
                                                                                   [-1.0, 8, "<8>"]]
    assert sglang_native.top_logprobs([[7, 9, 3], None], [[-0.5, -0.7, -2.0], None], 2) == [
        [[-0.5, 7, None], [-0.7, 9, None]], None]


def test_server_figures_from_the_servers_prometheus_text():
    text = "\n".join([
        "# TYPE specdec_accepted_length histogram",
        'specdec_accepted_length_bucket{le="+Inf",instance="0"} 10.0',
        'specdec_accepted_length_count{instance="0"} 10.0', 'specdec_accepted_length_sum{instance="0"} 15.0',
        'specdec_accepted_length_count{instance="1"} 10.0', 'specdec_accepted_length_sum{instance="1"} 5.0',
        "# TYPE specdec_accepted_draft_tokens_total counter",
        'specdec_accepted_draft_tokens_total{instance="0"} 15.0',
        'specdec_accepted_draft_tokens_total{instance="1"} 5.0',
        "# TYPE specdec_output_tokens_total counter", "specdec_output_tokens_total 123.0", ""])
    assert sglang_native.server_figures(text) == (2.0, 123.0)  # 1 + 20 accepted / 20 rounds
    assert sglang_native.server_figures("") == (None, 0.0)


def test_max_new_tokens_zero_scores_the_prompt_alone():
    native, [body] = bodies({"input_ids": [[1, 2], [3]], "return_logprob": True, "logprob_start_len": 0,
                             "sampling_params": {"max_new_tokens": 0}})
    assert native.score_only and body["max_tokens"] == 1 and body["prompt_logprobs"] == 0
    with pytest.raises(ApiError) as refused:
        bodies({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 2}]})
    assert refused.value.param == "sampling_params.max_new_tokens"
    assert not bodies({"text": "a"})[0].score_only



def test_incremental_streaming_sends_what_each_event_adds():
    """--incremental-streaming-output: each event's text, tokens and output log-probabilities are what it adds to
    those sent before; the counts and the rest of meta_info are the output's so far, as SGLang sends them; the
    events concatenate to the whole output."""
    outputs = [{"text": "Hel", "output_ids": [5], "meta_info": {"completion_tokens": 1, "finish_reason": None,
                                                                 "output_token_logprobs": [[-0.1, 5, None]]}},
               {"text": "Hello wor", "output_ids": [5, 6, 7], "meta_info": {
                   "completion_tokens": 3, "finish_reason": None,
                   "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]]}},
               {"text": "Hello world", "output_ids": [5, 6, 7, 8], "meta_info": {
                   "completion_tokens": 4, "finish_reason": {"type": "length", "length": 4},
                   "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None], [-0.4, 8, None]]}}]
    sent, events = (0, 0), []
    for output in outputs:
        events.append(sglang_native.incremental(output, *sent))
        sent = (len(output["text"]), len(output["output_ids"]))
    assert [event["text"] for event in events] == ["Hel", "lo wor", "ld"]
    assert [event["output_ids"] for event in events] == [[5], [6, 7], [8]]
    assert [len(event["meta_info"]["output_token_logprobs"]) for event in events] == [1, 2, 1]
    assert [event["meta_info"]["completion_tokens"] for event in events] == [1, 3, 4]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert sum((event["meta_info"]["output_token_logprobs"] for event in events), []) == \
        outputs[-1]["meta_info"]["output_token_logprobs"]
    assert outputs[1]["meta_info"]["output_token_logprobs"][0] == [-0.1, 5, None]  # the outputs are left as they were
