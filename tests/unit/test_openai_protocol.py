"""The OpenAI API's requests mapped onto the ensemble's inputs, and its error and response objects (pure; the
served API is tested in tests/integration/test_openai_api.py)."""

import json

import numpy as np
import pytest

from specdec import tensor_names as tn
from specdec.gateway import protocol
from specdec.gateway.protocol import ApiError, parse_chat, parse_completion, server_error

SERVED = ("m", "alias")
CHAT = [{"role": "user", "content": "hi"}]


def sampling(gen, index: int = 0) -> dict:
    return json.loads(gen.choices[index][tn.SAMPLING_PARAMETERS][0, 0].decode())


def test_chat_maps_settings_onto_sampling_parameters_and_inputs():
    gen = parse_chat({"model": "alias", "messages": CHAT, "max_completion_tokens": 9, "top_p": 0.5, "seed": 3,
                      "stop": "x", "presence_penalty": 0.1, "logit_bias": {"7": -100}, "top_k": -1,
                      "num_draft_tokens": 5, "draft_model": "ngram", "adaptive_draft": False, "user": "u1",
                      "num_draft_branches": 1}, SERVED)
    assert gen.model == "alias" and gen.chat and not gen.stream
    assert sampling(gen) == {"temperature": 1.0, "top_p": 0.5, "seed": 3, "stop": "x", "presence_penalty": 0.1,
                             "top_k": -1, "max_tokens": 9, "logit_bias": {"7": -100},
                             "stream_interval_ms": protocol.WHOLE_ANSWER_STREAM_INTERVAL_MS}
    assert gen.choices[0][tn.NUM_DRAFT_TOKENS].dtype == np.int32 and gen.choices[0][tn.NUM_DRAFT_TOKENS][0, 0] == 5
    assert gen.choices[0][tn.DRAFT_MODEL][0, 0] == b"ngram" and gen.choices[0][tn.ADAPTIVE_DRAFT][0, 0] == np.False_
    assert gen.choices[0][tn.NUM_DRAFT_BRANCHES].dtype == np.int32 and gen.choices[0][tn.NUM_DRAFT_BRANCHES][0, 0] == 1
    assert json.loads(gen.choices[0][tn.MESSAGES][0, 0]) == CHAT and tn.TEXT_INPUT not in gen.choices[0]
    assert gen.response_id.startswith("chatcmpl-")


def test_every_answer_is_streamed_by_the_server_a_whole_one_at_an_interval():
    """What makes a cancel reach the generation (through the ensemble only a streamed response carries it):
    an answer asked whole is streamed too, a response at most every WHOLE_ANSWER_STREAM_INTERVAL_MS; a
    streamed one every round."""
    for parse, body in ((parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "hi", "n": 2})):
        whole, streamed = parse({"model": "m", **body}, SERVED), parse({"model": "m", "stream": True, **body}, SERVED)
        assert all(c[tn.STREAM][0, 0] for c in whole.choices + streamed.choices) and not whole.stream
        assert {sampling(whole, i)["stream_interval_ms"] for i in range(len(whole.choices))} == {100}
        assert all("stream_interval_ms" not in sampling(streamed, i) for i in range(len(streamed.choices)))


def test_a_stream_interval_is_a_sampling_setting():
    """stream_interval (tokens; SGLang's name, the server's default otherwise): a streamed answer's chunks at
    least that many tokens apart, passed on as a sampling_parameters key (the server checks its range)."""
    for parse, body in ((parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "hi"})):
        gen = parse({"model": "m", "stream": True, "stream_interval": 4, **body}, SERVED)
        assert sampling(gen)["stream_interval"] == 4
        assert "stream_interval" not in sampling(parse({"model": "m", "stream": True, **body}, SERVED))


def test_priority_is_the_ensembles_priority_input():
    for parse, body in ((parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "hi", "n": 2})):
        gen = parse({"model": "m", "priority": -3, **body}, SERVED)
        assert all(c[tn.PRIORITY].dtype == np.int32 and c[tn.PRIORITY][0, 0] == -3 for c in gen.choices)
        assert tn.PRIORITY not in parse({"model": "m", **body}, SERVED).choices[0]


def test_chat_template_kwargs_and_include_reasoning_are_read():
    gen = parse_chat({"model": "m", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, SERVED,
                     reasoning_parser="qwen3")
    assert json.loads(gen.choices[0][tn.CHAT_TEMPLATE_KWARGS][0, 0]) == {"enable_thinking": False}
    assert gen.reasoning == "qwen3" and gen.include_reasoning
    plain = parse_chat({"model": "m", "messages": CHAT, "include_reasoning": False}, SERVED)
    assert tn.CHAT_TEMPLATE_KWARGS not in plain.choices[0] and plain.reasoning is None and not plain.include_reasoning
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "m", "messages": CHAT, "chat_template_kwargs": ["x"]}, SERVED)
    assert caught.value.param == "chat_template_kwargs"
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "m", "messages": CHAT, "include_reasoning": "no"}, SERVED)
    assert caught.value.param == "include_reasoning"
    with pytest.raises(ApiError) as caught:  # a chat setting: completions do not take it
        parse_completion({"model": "m", "prompt": "hi", "chat_template_kwargs": {}}, SERVED)
    assert caught.value.param == "chat_template_kwargs"


def test_documents_are_the_chat_templates_documents():
    """vLLM's `documents` (a RAG template's sources) reach the chat template as its call's `documents`, through
    chat_template_kwargs (whose own `documents` wins, as vLLM's do); anything but a list of objects of strings
    is refused naming the field."""
    docs = [{"title": "A", "text": "alpha"}, {"text": "beta"}]
    gen = parse_chat({"model": "m", "messages": CHAT, "documents": docs, "reasoning_effort": "low"}, SERVED)
    assert json.loads(gen.choices[0][tn.CHAT_TEMPLATE_KWARGS][0, 0]) == {"documents": docs, "reasoning_effort": "low"}
    given = parse_chat({"model": "m", "messages": CHAT, "documents": docs,
                        "chat_template_kwargs": {"documents": docs[:1]}}, SERVED)
    assert json.loads(given.choices[0][tn.CHAT_TEMPLATE_KWARGS][0, 0]) == {"documents": docs[:1]}
    for bad, param in (({"text": "x"}, "documents"), ([{"text": "x"}, "y"], "documents[1]"),
                       ([{"text": 3}], "documents[0]")):
        with pytest.raises(ApiError) as caught:
            parse_chat({"model": "m", "messages": CHAT, "documents": bad}, SERVED)
        assert caught.value.param == param and caught.value.status == 400
    with pytest.raises(ApiError) as caught:  # a chat's: completions do not take it
        parse_completion({"model": "m", "prompt": "hi", "documents": docs}, SERVED)
    assert caught.value.param == "documents"


def test_a_structured_output_of_a_reasoning_model_constrains_its_answer():
    """With a reasoning parser, a chat's guide (response_format, vLLM's fields, a named tool) names the parser
    to the ensemble, which applies the guide after the thinking; nothing else does."""
    fmt = {"response_format": {"type": "json_object"}}
    tool = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    for extra in (fmt, {"structured_outputs": {"regex": "[0-9]+"}}, {"guided_choice": ["a", "b"]}, tool):
        gen = parse_chat({"model": "m", "messages": CHAT, **extra}, SERVED, tool_parser="hermes",
                         reasoning_parser="deepseek_r1")
        assert gen.choices[0][tn.REASONING_PARSER][0, 0] == b"deepseek_r1", extra
        assert tn.REASONING_PARSER not in parse_chat({"model": "m", "messages": CHAT, **extra}, SERVED,
                                                     tool_parser="hermes").choices[0]
    assert tn.REASONING_PARSER not in parse_chat({"model": "m", "messages": CHAT}, SERVED,
                                                 reasoning_parser="qwen3").choices[0]


def test_reasoning_effort_is_a_variable_of_the_chat_template():
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) reach the chat template as the variable
    `reasoning_effort` (gpt-oss's templates read it); an explicit chat_template_kwargs value wins."""
    gen = parse_chat({"model": "m", "messages": CHAT, "reasoning_effort": "low"}, SERVED)
    assert json.loads(gen.choices[0][tn.CHAT_TEMPLATE_KWARGS][0, 0]) == {"reasoning_effort": "low"}
    both = parse_chat({"model": "m", "messages": CHAT, "reasoning_effort": "low",
                       "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True}}, SERVED)
    assert json.loads(both.choices[0][tn.CHAT_TEMPLATE_KWARGS][0, 0]) == {"reasoning_effort": "high",
                                                                         "enable_thinking": True}
    for bad in ("extreme", 3):
        with pytest.raises(ApiError) as caught:
            parse_chat({"model": "m", "messages": CHAT, "reasoning_effort": bad}, SERVED)
        assert caught.value.param == "reasoning_effort"


def test_a_chat_choice_carries_its_thinking_under_both_names():
    gen = parse_chat({"model": "m", "messages": CHAT}, SERVED, reasoning_parser="deepseek_r1")
    message = protocol.choice(gen, None, "length", None, delta=False, reasoning="hmm")["message"]
    assert message == {"role": "assistant", "content": None, "reasoning_content": "hmm", "reasoning": "hmm"}
    delta = protocol.choice(gen, "4", None, None, delta=True, reasoning="")["delta"]
    assert delta == {"content": "4"}  # no thinking in this delta: neither name
    hidden = parse_chat({"model": "m", "messages": CHAT, "include_reasoning": False}, SERVED, reasoning_parser="qwen3")
    assert "reasoning" not in protocol.choice(hidden, "4", None, None, delta=False, reasoning="hmm")["message"]


def test_messages_are_normalized_for_the_chat_template():
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
                {"role": "assistant", "content": "ok", "tool_calls": []}]
    assert protocol.chat_messages({"messages": messages}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab", "name": "x"},
        {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 2.0}, "n"), ({"tool_choice": "auto"}, "tool_choice"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"), ({"max_tokens": "4"}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"stream": "yes"}, "stream"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x"), ({"bogus": 1}, "bogus"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls[0]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "no"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"), ({"num_draft_tokens": 2.5}, "num_draft_tokens"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"num_draft_tokens": 2**40}, "num_draft_tokens"), ({"priority": 2**31}, "priority"), ({"priority": "high"}, "priority"),
    ({"priority": True}, "priority"), ({"modalities": ["text", "audio"]}, "modalities"), ({"modalities": "text"}, "modalities"),
    ({"verbosity": "low"}, "verbosity"), ({"verbosity": "high"}, "verbosity"), ({"moderation": {}}, "moderation"),
])
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "m", "messages": CHAT, **body}, SERVED)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_404_and_none_is_the_first():
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "other", "messages": CHAT}, SERVED)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    assert parse_chat({"messages": CHAT}, SERVED).model == "m"


def test_a_lora_adapters_name_is_a_model_whose_requests_run_it():
    from specdec.gateway.protocol import Served

    served = Served(["m", "alias"], ["sql", "m"])  # a name already the model's stays the model's
    assert tuple(served) == ("m", "alias", "sql") and served.adapters == {"sql"}
    for gen in (parse_chat({"model": "sql", "messages": CHAT}, served), parse_completion({"model": "sql", "prompt": ["a", "b"]}, served)):
        assert gen.model == "sql" and all(choice[tn.LORA_NAME][0, 0] == b"sql" for choice in gen.choices)
    for body in ({"messages": CHAT}, {"model": "alias", "messages": CHAT}):
        assert tn.LORA_NAME not in parse_chat(body, served).choices[0]
    with pytest.raises(ApiError, match="does not exist"):
        parse_chat({"model": "other", "messages": CHAT}, served)


def test_response_format_and_guided_fields_become_structured_outputs():
    schema = {"type": "object"}
    gen = parse_chat({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                     SERVED)
    assert sampling(gen)["structured_outputs"] == {"json": schema}
    assert sampling(parse_chat({"messages": CHAT, "response_format": {"type": "json_object"}}, SERVED))[
        "structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in sampling(parse_chat({"messages": CHAT, "response_format": {"type": "text"}}, SERVED))
    assert parse_chat({"messages": CHAT, "modalities": ["text"]}, SERVED).choices  # OpenAI's default, accepted
    # OpenAI's default verbosity asks nothing of a model; prompt caching's options are bookkeeping here (automatic)
    assert parse_chat({"messages": CHAT, "verbosity": "medium", "prompt_cache_options": {"mode": "explicit"}},
                      SERVED).choices
    tags = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
            "triggers": ["<f>"]}
    assert sampling(parse_chat({"messages": CHAT, "response_format": tags}, SERVED))["structured_outputs"] == {
        "structural_tag": tags}  # (vLLM's form, "type" in it: the guide checks the rest when it compiles)
    assert sampling(parse_completion({"prompt": "p", "guided_choice": ["a", "b"]}, SERVED))["structured_outputs"] == {
        "choice": ["a", "b"]}
    # vLLM's completions take response_format as its chat does
    assert sampling(parse_completion({"prompt": "p", "response_format": {"type": "json_object"}}, SERVED))[
        "structured_outputs"] == {"json_object": True}
    assert sampling(parse_completion({"prompt": "p", "response_format": {
        "type": "json_schema", "json_schema": {"schema": schema}}}, SERVED))["structured_outputs"] == {"json": schema}
    assert "structured_outputs" not in sampling(parse_completion({"prompt": "p", "response_format": {"type": "text"}},
                                                                 SERVED))
    with pytest.raises(ApiError, match="response_format: and structured_outputs both constrain") as both:
        parse_completion({"prompt": "p", "response_format": {"type": "json_object"}, "guided_regex": "a"}, SERVED)
    assert both.value.param == "response_format"
    # vLLM's older options beside them: the JSON's whitespace pattern, the backend (any: this server has one)
    assert sampling(parse_completion({"prompt": "p", "guided_json": schema, "guided_whitespace_pattern": "[ ]?",
                                      "guided_decoding_backend": "xgrammar"}, SERVED))["structured_outputs"] == {
        "json": schema, "whitespace_pattern": "[ ]?", "backend": "xgrammar"}
    assert "structured_outputs" not in sampling(parse_completion({"prompt": "p", "guided_decoding_backend": "x"},
                                                                 SERVED))


def test_chat_echo_leads_with_the_assistants_last_message():
    """vLLM's chat echo: the chat's last message where it is the assistant's (a prefilled answer), else none."""
    prefilled = [*CHAT, {"role": "assistant", "content": [{"type": "text", "text": "Sure"}]}]
    assert parse_chat({"messages": prefilled, "echo": True, "continue_final_message": True,
                       "add_generation_prompt": False}, SERVED).chat_echo == "Sure"
    assert parse_chat({"messages": CHAT, "echo": True}, SERVED).chat_echo == ""
    assert parse_chat({"messages": prefilled}, SERVED).chat_echo == ""
    with pytest.raises(ApiError, match="echo"):
        parse_chat({"messages": CHAT, "echo": "yes"}, SERVED)


def test_completions_echo_asks_for_the_prompts_scores_and_max_tokens_zero_scores_only():
    gen = parse_completion({"model": "m", "prompt": [[5, 6, 7], [8, 9]], "echo": True, "logprobs": 1, "max_tokens": 0,
                            "temperature": 0}, SERVED)
    assert gen.echo == [[5, 6, 7], [8, 9]] and gen.score_only and gen.top_logprobs == 1
    assert all(choice[tn.RETURN_PROMPT_LOG_PROBS][0, 0] and choice[tn.NUM_TOP_LOG_PROBS][0, 0] == 1
               for choice in gen.choices)
    assert sampling(gen)["max_tokens"] == 1  # one is generated, never sent
    plain = parse_completion({"model": "m", "prompt": "text", "echo": True, "n": 2, "max_tokens": 5}, SERVED)
    # A completion continues the text as given: the server's default chat template is turned off for it
    assert not plain.choices[1][tn.APPLY_CHAT_TEMPLATE][0, 0] and tn.APPLY_CHAT_TEMPLATE not in gen.choices[0]
    assert plain.echo == ["text", "text"] and not plain.score_only and tn.RETURN_PROMPT_LOG_PROBS not in plain.choices[0]
    assert parse_completion({"model": "m", "prompt": "text"}, SERVED).echo is None
    # max_tokens 0 only means "score only" with echo: otherwise it goes as sent, and the server refuses it
    assert sampling(parse_completion({"model": "m", "prompt": "text", "max_tokens": 0}, SERVED))["max_tokens"] == 0


def test_prompt_logprobs_ask_for_the_prompts_scores_and_the_most_tops_of_both_lists():
    """vLLM's prompt_logprobs k: the prompt scored, the server's top rows as many as the larger of k and
    top_logprobs; refused streamed or out of range, naming it; a completion's echo with logprobs lists them too
    (as vLLM's does), unless streamed."""
    chat = parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 5}, SERVED)
    assert chat.prompt_logprobs == 5 and chat.top_logprobs == 2 and chat.server_top == 5
    assert chat.choices[0][tn.RETURN_PROMPT_LOG_PROBS][0, 0] and chat.choices[0][tn.NUM_TOP_LOG_PROBS][0, 0] == 5
    alone = parse_completion({"prompt": "p", "prompt_logprobs": 0}, SERVED)
    assert alone.prompt_logprobs == 0 and not alone.logprobs and tn.NUM_TOP_LOG_PROBS not in alone.choices[0]
    assert alone.choices[0][tn.RETURN_PROMPT_LOG_PROBS][0, 0]
    assert parse_completion({"prompt": "p", "logprobs": 3, "prompt_logprobs": 1}, SERVED).server_top == 3
    bare = parse_chat({"messages": CHAT, "prompt_logprobs": 4}, SERVED)  # the server sends top rows with log-probs
    assert not bare.logprobs and bare.choices[0][tn.RETURN_LOG_PROBS][0, 0] and bare.server_top == 4
    assert parse_chat({"messages": CHAT}, SERVED).prompt_logprobs is None
    assert parse_completion({"prompt": "p", "echo": True, "logprobs": 2}, SERVED).prompt_logprobs == 2
    streamed = parse_completion({"prompt": "p", "echo": True, "logprobs": 2, "stream": True}, SERVED)
    assert streamed.prompt_logprobs is None
    for body, words in (({"prompt_logprobs": 21}, r"within \[0, 20\]"), ({"prompt_logprobs": -1}, "within"),
                        ({"prompt_logprobs": "3"}, "an integer"), ({"prompt_logprobs": 2, "stream": True}, "stream")):
        for parse, base in ((parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "p"})):
            with pytest.raises(ApiError, match=words) as caught:
                parse({**base, **body}, SERVED)
            assert caught.value.param == "prompt_logprobs" and caught.value.status == 400


def test_prompt_logprobs_list_each_tokens_own_entry_then_its_positions_most_likely():
    names = {5: "a", 6: "b", 7: "c", 9: "z"}.__getitem__
    listed = protocol.prompt_logprobs([5, 6, 7], [None, -0.5, -3.0], [None, 1, 4], [None, [6, 9], [9, 6]],
                                      [None, [-0.5, -1.5], [-0.2, -1.9]], 2, names)
    assert listed[0] is None and list(listed[1]) == [6, 9] and list(listed[2]) == [7, 9, 6]  # its own first, once
    assert listed[1][6] == {"logprob": -0.5, "rank": 1, "decoded_token": "b"}
    assert listed[2][7] == {"logprob": -3.0, "rank": 4, "decoded_token": "c"} and listed[2][6]["rank"] == 2
    assert json.loads(json.dumps(listed))[2]["9"]["decoded_token"] == "z"  # ids as JSON keys: strings
    own = protocol.prompt_logprobs([5, 6, 7], [None, -0.5, -3.0], [None, 1, 4], [], [], 0, names)
    assert own == [None, {6: {"logprob": -0.5, "rank": 1, "decoded_token": "b"}},
                   {7: {"logprob": -3.0, "rank": 4, "decoded_token": "c"}}]
    assert protocol.prompt_logprobs([], [], [], [], [], 1, names) == []


def test_return_token_ids_asks_for_the_prompts_ids_and_places_them_as_vllm_does():
    chat = parse_chat({"messages": CHAT, "n": 2, "return_token_ids": True}, SERVED)
    assert chat.return_token_ids and all(choice[tn.RETURN_PROMPT_IDS][0, 0] for choice in chat.choices)
    assert not parse_chat({"messages": CHAT, "return_token_ids": False}, SERVED).return_token_ids
    assert tn.RETURN_PROMPT_IDS not in parse_chat({"messages": CHAT}, SERVED).choices[0]
    with pytest.raises(ApiError, match="return_token_ids"):
        parse_completion({"prompt": "p", "return_token_ids": 1}, SERVED)
    body, entry = {}, {}  # a chat's answer: the prompt's on the body, the answer's on the choice
    protocol.add_token_ids(chat, body, entry, [1, 2], [3], first=True)
    assert body == {"prompt_token_ids": [1, 2]} and entry == {"token_ids": [3]}
    streamed = parse_chat({"messages": CHAT, "stream": True, "return_token_ids": True}, SERVED)
    body, entry = {}, {}  # (its role chunk carries the prompt's)
    protocol.add_token_ids(streamed, body, entry, [1, 2], [3], first=True)
    assert body == {} and entry == {"token_ids": [3]}
    echo = parse_completion({"prompt": "p", "echo": True, "return_token_ids": True}, SERVED)
    body, entry = {}, {}  # a completion's on its choice; an echo's answer starts with the prompt
    protocol.add_token_ids(echo, body, entry, [1, 2], [3], first=True)
    assert body == {} and entry == {"token_ids": [1, 2, 3], "prompt_token_ids": [1, 2]}
    protocol.add_token_ids(echo, body, entry, [], [4], first=False)
    assert entry == {"token_ids": [4], "prompt_token_ids": [1, 2]}


def test_a_cache_salt_is_the_ensembles_input():
    gen = parse_completion({"prompt": ["a", "b"], "cache_salt": "tenant-1"}, SERVED)
    assert all(choice[tn.CACHE_SALT][0, 0] == b"tenant-1" for choice in gen.choices)
    assert tn.CACHE_SALT not in parse_chat({"messages": CHAT}, SERVED).choices[0]
    for salt in ("", 5):
        with pytest.raises(ApiError) as caught:
            parse_chat({"messages": CHAT, "cache_salt": salt}, SERVED)
        assert caught.value.param == "cache_salt"


def test_a_request_id_comes_from_the_header_else_the_body():
    assert protocol.request_id("hdr", {"request_id": "body"}) == "hdr"
    assert protocol.request_id(None, {"request_id": "body"}) == "body"
    assert protocol.request_id(None, {}) is None
    for header, body, param in (("", {}, "X-Request-Id"), (None, {"request_id": "a\nb"}, "request_id"),
                                (None, {"request_id": "x" * 257}, "request_id"),
                                (None, {"request_id": 3}, "request_id")):
        with pytest.raises(ApiError) as caught:
            protocol.request_id(header, body)
        assert caught.value.param == param


def test_echoed_logprobs_start_with_none_for_the_first_prompt_token():
    body = protocol.logprobs_object(False, ["a", "b", "c"], [None, -1.0, -0.5], 0, [None, [("b", -1.0), ("x", -2.0)], [("c", -0.5)]])
    assert body["token_logprobs"] == [None, -1.0, -0.5] and body["top_logprobs"][0] is None
    assert body["top_logprobs"][1] == {"b": -1.0, "x": -2.0} and body["text_offset"] == [0, 1, 2]


def test_completions_take_one_prompt_and_logprobs_zero():
    gen = parse_completion({"model": "m", "prompt": ["only"], "logprobs": 0, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                            "temperature": 0, "ignore_eos": True, "min_tokens": 3}, SERVED)
    assert gen.choices[0][tn.TEXT_INPUT][0, 0] == b"only" and gen.logprobs and gen.choices[0][tn.RETURN_LOG_PROBS][0, 0]
    assert gen.stream and gen.include_usage and gen.continuous_usage and gen.choices[0][tn.STREAM][0, 0]
    # no max_tokens: what the context leaves (the server's max_max_tokens at most), as on OpenAI's API and vLLM's
    assert sampling(gen) == {"temperature": 0, "ignore_eos": True, "min_tokens": 3, tn.MAX_TOKENS_TO_CONTEXT: True}
    for body, param in (({"prompt": []}, "prompt"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": ["a", 3]}, "prompt"),
                        ({"prompt": [-1]}, "prompt"), ({"prompt": [True]}, "prompt"), ({"prompt": ["a", [3]]}, "prompt"),
                        ({"prompt": "a", "echo": 1}, "echo"),
                        ({"prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": "a", "best_of": 2}, "best_of"),
                        ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"), ({"prompt": ["a"] * 65, "n": 2}, "n"),
                        ({"prompt": "a", "suffix": "z"}, "suffix"), ({"prompt": "a", "messages": CHAT}, "messages")):
        with pytest.raises(ApiError) as caught:
            parse_completion(body, SERVED)
        assert caught.value.param == param


def test_vllms_beam_and_tokenizing_fields_at_their_defaults_are_taken():
    """Clients written for vLLM send its beam-search settings and add_special_tokens at their defaults: taken,
    asking nothing; beam search itself, or the other add_special_tokens, refused naming the field."""
    vllm = {"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False}
    chat = parse_chat({"messages": CHAT, "best_of": 2, "n": 2, "add_special_tokens": False, **vllm}, SERVED)
    completion = parse_completion({"prompt": "a", "add_special_tokens": True, **vllm, "early_stopping": "never"},
                                  SERVED)
    assert chat.n == 2 and sampling(chat) == sampling(parse_chat({"messages": CHAT, "n": 2}, SERVED))
    assert sampling(completion) == sampling(parse_completion({"prompt": "a"}, SERVED))
    for parse, body, param in ((parse_chat, {"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
                               (parse_completion, {"prompt": "a", "use_beam_search": True}, "use_beam_search"),
                               (parse_chat, {"messages": CHAT, "best_of": 3}, "best_of"),
                               (parse_chat, {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
                               (parse_completion, {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
                               (parse_completion, {"prompt": "a", "length_penalty": "x"}, "length_penalty"),
                               (parse_chat, {"messages": CHAT, "early_stopping": "always"}, "early_stopping")):
        with pytest.raises(ApiError) as caught:
            parse(body, SERVED)
        assert caught.value.param == param, body


def test_prompts_may_be_token_ids():
    one = parse_completion({"prompt": [5, 6, 7]}, SERVED)
    assert len(one.choices) == 1 and tn.TEXT_INPUT not in one.choices[0]
    assert one.choices[0][tn.PROMPT_TOKEN_IDS].tolist() == [[5, 6, 7]] and one.choices[0][tn.PROMPT_TOKEN_IDS].dtype == np.int32
    several = parse_completion({"prompt": [[1, 2], [3]], "n": 2}, SERVED)
    assert [c[tn.PROMPT_TOKEN_IDS].tolist() for c in several.choices] == [[[1, 2]]] * 2 + [[[3]]] * 2
    refused = server_error(f"in ensemble 'ensemble', input '{tn.PROMPT_TOKEN_IDS}' must hold token ids within [0, 9)")
    assert (refused.status, refused.param) == (400, "prompt")


def test_choices_are_one_generation_each_in_openai_order():
    """n choices of each prompt, prompt by prompt (index = prompt * n + j); a seeded request's choice j
    samples with seed + j (reproducible, and not n copies of one answer); unseeded ones stay unseeded."""
    gen = parse_completion({"prompt": ["p0", "p1"], "n": 3, "best_of": 3, "seed": 7, "temperature": 0.5}, SERVED)
    assert gen.n == 3 and len(gen.choices) == 6
    assert [c[tn.TEXT_INPUT][0, 0] for c in gen.choices] == [b"p0"] * 3 + [b"p1"] * 3
    assert [sampling(gen, i)["seed"] for i in range(6)] == [7, 8, 9, 7, 8, 9]
    assert all(sampling(gen, i)["temperature"] == 0.5 for i in range(6))
    assert sampling(parse_completion({"prompt": "p", "seed": 2**64 - 1, "n": 2}, SERVED), 1)["seed"] == 0
    chat = parse_chat({"messages": CHAT, "n": 2}, SERVED)
    assert len(chat.choices) == 2 and all("seed" not in sampling(chat, i) for i in range(2))
    assert chat.choices[0][tn.MESSAGES][0, 0] == chat.choices[1][tn.MESSAGES][0, 0]


def test_choices_combine_into_one_usage_and_one_set_of_statistics():
    """A prompt's tokens count once for its n choices; completions add up; the rates are recomputed from
    the summed counts, as the server computes them for one."""
    a = {tn.NUM_INPUT_TOKENS: 10, tn.NUM_OUTPUT_TOKENS: 4, tn.NUM_ROUNDS: 2, tn.TOTAL_DRAFT_TOKENS: 6,
         tn.TOTAL_ACCEPTED_DRAFT_TOKENS: 2, tn.ACCEPTANCE_RATE: 1 / 3, tn.MEAN_ACCEPTED_LENGTH: 2.0,
         tn.NUM_CACHED_TOKENS: 0}
    b = {tn.NUM_INPUT_TOKENS: 10, tn.NUM_OUTPUT_TOKENS: 6, tn.NUM_ROUNDS: 2, tn.TOTAL_DRAFT_TOKENS: 2,
         tn.TOTAL_ACCEPTED_DRAFT_TOKENS: 2, tn.ACCEPTANCE_RATE: 1.0, tn.MEAN_ACCEPTED_LENGTH: 2.0,
         tn.NUM_CACHED_TOKENS: 8}
    c = {tn.NUM_INPUT_TOKENS: 3, tn.NUM_OUTPUT_TOKENS: 1, tn.NUM_ROUNDS: 1, tn.TOTAL_DRAFT_TOKENS: 0,
         tn.TOTAL_ACCEPTED_DRAFT_TOKENS: 0, tn.ACCEPTANCE_RATE: 0.0, tn.MEAN_ACCEPTED_LENGTH: 1.0}
    # the last choice: tokens seen so far; a prompt's cached tokens: those every one of its choices found
    assert protocol.combined_usage([a, b, c, {}], [4, 6, 1, 2], n=2) == {
        "prompt_tokens": 13, "completion_tokens": 13, "total_tokens": 26, "prompt_tokens_details": {"cached_tokens": 0}}
    assert protocol.combined_usage([b, b, a, a], [6, 6, 4, 4], n=2)["prompt_tokens_details"] == {"cached_tokens": 8}
    combined = protocol.combined_stats([a, b, c])
    assert combined == {tn.NUM_ROUNDS: 5, tn.TOTAL_DRAFT_TOKENS: 8, tn.TOTAL_ACCEPTED_DRAFT_TOKENS: 4,
                        tn.ACCEPTANCE_RATE: 0.5, tn.MEAN_ACCEPTED_LENGTH: 1.8}
    assert protocol.combined_stats([a]) == {k: v for k, v in a.items() if k in protocol.STATS}
    assert protocol.combined_stats([{}, {}])[tn.ACCEPTANCE_RATE] == 0.0


def test_server_refusals_become_openai_errors_naming_the_request_field():
    key = server_error("in ensemble 'ensemble', input 'sampling_parameters': key 'top_k' must be an integer")
    assert (key.status, key.param, key.message) == (400, "top_k", "top_k must be an integer")
    stop = server_error("input 'stop_words' has 20 words; at most 16")
    assert (stop.status, stop.param, stop.message) == (400, "stop", "stop has 20 words; at most 16")
    # a guide's refusal names the field it came from: a forced tool call's schema came from the tools
    guide = server_error(f"input '{tn.GUIDED_DECODING_GUIDE}' (json_schema): properties must be an object")
    assert (guide.param, guide.message) == ("response_format", "response_format (json_schema): properties must be "
                                                               "an object")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    forced = parse_chat({"messages": CHAT, "tools": tools, "tool_choice": "required"}, SERVED)
    assert forced.guide_field == "tools" and protocol.guide_error(guide, forced.guide_field).message == \
        "tools (json_schema): properties must be an object"
    assert parse_chat({"messages": CHAT, "response_format": {"type": "json_object"}}, SERVED).guide_field == \
        "response_format"
    assert parse_completion({"prompt": "p", "guided_regex": "a+"}, SERVED).guide_field == "guided_regex"
    assert protocol.guide_error(key, "tools") is key
    # reworded only where the input leads the message (after the ensemble's, a request id's or a model's prefix)
    told = server_error("the chat template failed: input 'messages' is not a list")
    assert (told.param, told.message) == ("messages", "the chat template failed: input 'messages' is not a list")
    assert server_error("[request id: 7] preprocessing: input 'max_tokens' must be within [1, 1024], got -3"
                        ).message == "max_tokens must be within [1, 1024], got -3"
    busy = server_error(f"max_live_sequences (8) reached; {tn.RETRY_LATER}")
    assert (busy.status, busy.code) == (503, "server_busy")
    assert server_error("Stub process is not healthy").status == 500
    assert server_error("connection refused", unavailable=True).status == 503
    # a chat's prompt is what the server rendered from its messages: a chat names `messages`
    long = server_error(f"input '{tn.TEXT_INPUT}' has 1100 tokens; with 'max_tokens'=4 that exceeds the model context")
    assert long.param == "prompt" and protocol.chat_error(long).param == "messages"
    assert protocol.chat_error(long).message.startswith("messages has 1100 tokens")
    assert protocol.chat_error(stop) is stop


def test_top_log_probs_are_asked_for_and_shown_as_openai_does():
    chat = parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": 3, "n": 2}, SERVED)
    assert chat.top_logprobs == 3 and all(c[tn.NUM_TOP_LOG_PROBS][0, 0] == 3 for c in chat.choices)
    assert tn.NUM_TOP_LOG_PROBS not in parse_chat({"messages": CHAT, "logprobs": True}, SERVED).choices[0]
    text = parse_completion({"prompt": "p", "logprobs": 5}, SERVED)
    assert text.logprobs and text.top_logprobs == 5 and text.choices[0][tn.NUM_TOP_LOG_PROBS][0, 0] == 5
    top = [[("a", -0.1), ("b", -2.5)], [("c", -0.7), ("c", -0.9)]]
    entries = protocol.logprobs_object(True, ["a", "c"], [-0.1, -0.7], top=top)["content"]
    assert entries[1]["top_logprobs"] == [{"token": "c", "logprob": -0.7, "bytes": [99]},
                                          {"token": "c", "logprob": -0.9, "bytes": [99]}]
    legacy = protocol.logprobs_object(False, ["a", "c"], [-0.1, -0.7], top=top)
    assert legacy["top_logprobs"] == [{"a": -0.1, "b": -2.5}, {"c": -0.7}]  # one text once: the likelier
    assert [list(row) for row in legacy["top_logprobs"]] == [["a", "b"], ["c"]]  # most likely first


def test_log_probs_objects_and_chunks():
    chat = protocol.logprobs_object(True, ["a", "é"], [-0.5, -1.0])
    assert chat["content"][1] == {"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": []}
    # the bytes a token stands for where given (text.token_bytes): a character split over tokens joins from them
    split = protocol.logprobs_object(True, ["\ufffd", "\ufffd"], [-0.5, -1.0], top=[[("\ufffd", -0.5)], [("x", -1.0)]],
                                     raw=[b"\xc3", b"\xa9"], top_raw=[[b"\xc3"], None])["content"]
    assert [e["bytes"] for e in split] == [[0xc3], [0xa9]] and bytes(sum((e["bytes"] for e in split), [])) == "é".encode()
    assert split[0]["top_logprobs"][0]["bytes"] == [0xc3] and split[1]["top_logprobs"][0]["bytes"] == [120]
    named = protocol.logprobs_object(False, ["token_id:7", "token_id:8"], [-1.0, -2.0], offset=5, widths=[2, 1])
    assert named["text_offset"] == [5, 7]  # tokens named by id: the offsets count their text (widths)
    assert parse_chat({"messages": CHAT, "return_tokens_as_token_ids": True}, SERVED).tokens_as_ids
    assert not parse_completion({"prompt": "p"}, SERVED).tokens_as_ids
    with pytest.raises(ApiError, match="return_tokens_as_token_ids"):
        parse_completion({"prompt": "p", "return_tokens_as_token_ids": 1}, SERVED)
    text = protocol.logprobs_object(False, ["ab", "c", "de"], [-1.0, -2.0, -3.0], offset=5)
    assert text["text_offset"] == [5, 7, 8] and text["tokens"] == ["ab", "c", "de"]
    gen = parse_chat({"messages": CHAT, "stream": True}, SERVED)
    first = protocol.choice(gen, "", None, None, delta=True, first=True)
    assert protocol.choice(gen, "y", None, None, delta=True, index=3)["index"] == 3
    later = protocol.choice(gen, "x", "stop", None, delta=True)
    assert first["delta"] == {"role": "assistant", "content": ""} and later["delta"] == {"content": "x"}
    chunk = protocol.envelope(gen, [later], chunk=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == gen.response_id
    assert protocol.sse(chunk).startswith(b"data: {") and protocol.sse("[DONE]") == b"data: [DONE]\n\n"


def test_a_generations_responses_add_up_to_its_whole_answer():
    from specdec.gateway.upstream import Piece

    whole = Piece()
    whole.add(Piece("Hel", [1, 2], [-0.5, -1.0], [[1], [2]], [[-0.5], [-1.0]], prompt_ids=[7, 8],
                    prompt_log_probs=[None, -2.0], prompt_top_ids=[None, [8]], prompt_top_log_probs=[None, [-2.0]],
                    stats={"a": 1.0}))
    whole.add(Piece("lo", [3], [-0.25], [[3]], [[-0.25]], finish_reason="length", stats={"a": 2.0, "b": 3.0}))
    whole.add(Piece(""))  # an empty last response keeps the reason
    assert (whole.text, whole.ids, whole.log_probs, whole.top_ids) == ("Hello", [1, 2, 3], [-0.5, -1.0, -0.25],
                                                                      [[1], [2], [3]])
    assert whole.top_log_probs == [[-0.5], [-1.0], [-0.25]] and whole.finish_reason == "length"
    assert (whole.prompt_ids, whole.prompt_log_probs, whole.prompt_top_ids) == ([7, 8], [None, -2.0], [None, [8]])
    assert whole.stats == {"a": 2.0, "b": 3.0}  # merged, the later values winning


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [[], {"a": 1}, "8", 1.5])
def test_a_token_limit_of_the_wrong_type_is_refused_naming_it(name, value):
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "m", "messages": CHAT, name: value}, SERVED)
    assert caught.value.status == 400 and caught.value.param == name


def test_the_mistral_parser_keeps_special_tokens_and_sends_ids_in_mistrals_form():
    """vLLM's way with Mistral: the answer's text keeps special tokens ([TOOL_CALLS]) where the model may call
    (tool_choice auto), and the ids of calls in the history are shortened to the 9 characters its chat
    templates require, a call and its result still paired."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "done"}]
    gen = parse_chat({"model": "m", "messages": history, "tools": tools}, SERVED, tool_parser="mistral")
    assert sampling(gen)["skip_special_tokens"] is False and gen.tools.parser == "mistral"
    sent = json.loads(gen.choices[0][tn.MESSAGES][0, 0])
    assert sent[1]["tool_calls"][0]["id"] == sent[2]["tool_call_id"] == "f01234567"
    # a named call's answer is the arguments alone: special tokens stay out; other parsers leave ids and text as sent
    named = parse_chat({"model": "m", "messages": history, "tools": tools,
                        "tool_choice": {"type": "function", "function": {"name": "f"}}}, SERVED, tool_parser="mistral")
    assert "skip_special_tokens" not in sampling(named)
    assert json.loads(named.choices[0][tn.MESSAGES][0, 0])[2]["tool_call_id"] == "f01234567"
    hermes = parse_chat({"model": "m", "messages": history, "tools": tools}, SERVED, tool_parser="hermes")
    assert "skip_special_tokens" not in sampling(hermes)
    assert json.loads(hermes.choices[0][tn.MESSAGES][0, 0])[2]["tool_call_id"] == "call_0123456789abcdef01234567"


def test_the_assistants_last_message_is_continued_where_asked():
    """vLLM's continue_final_message (add_generation_prompt false): the ensemble's input; refused where it cannot
    be what is asked (both true; a turn closed and none opened; a last message that is not the assistant's)."""
    chat = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green"}]
    gen = parse_chat({"model": "m", "messages": chat, "continue_final_message": True, "add_generation_prompt": False},
                     ("m",))
    assert gen.choices[0][tn.CONTINUE_FINAL_MESSAGE].tolist() == [[True]]
    assert tn.CONTINUE_FINAL_MESSAGE not in parse_chat({"model": "m", "messages": chat}, ("m",)).choices[0]
    for extra, param in (({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
                         ({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"continue_final_message": "yes"}, "continue_final_message")):
        with pytest.raises(ApiError) as caught:
            parse_chat({"model": "m", "messages": chat, **extra}, ("m",))
        assert caught.value.param == param, extra
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "m", "messages": chat[:1], "continue_final_message": True}, ("m",))
    assert caught.value.param == "continue_final_message" and "must be the assistant's" in caught.value.message
