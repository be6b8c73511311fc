"""Anthropic's Messages API's mapping onto the chat path (gateway/messages.py): messages and content blocks,
tools, thinking, output formats, refusals naming the field, the message and its stop reasons. The served
endpoint: tests/integration/test_openai_api.py (test_anthropic_*)."""

import json

import pytest

from specdec import tensor_names as tn
from specdec.gateway import messages
from specdec.gateway.protocol import ApiError, parse_chat

SERVED = ("m",)


def test_system_text_blocks_tool_uses_and_results_become_the_chats_messages():
    body = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
                    {"type": "text", "text": "And so?", "cache_control": {"type": "ephemeral"}}]}]}
    chat = messages.chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "And so?"}]
    assert chat["max_tokens"] == 9 and "system" not in chat
    gen = parse_chat(chat, SERVED)  # the chat path takes it as it is
    assert json.loads(gen.choices[0][tn.MESSAGES][0, 0])[2]["tool_calls"][0]["id"] == "toolu_1"


def test_tools_choices_thinking_formats_and_settings_take_the_chats_form():
    tool = {"name": "w", "description": "weather", "input_schema": {"type": "object"}}
    chat = messages.chat_body({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                               "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                               "stop_sequences": ["END"], "top_k": 5, "temperature": 0.5, "num_draft_tokens": 3,
                               "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"},
                               "cache_control": {"type": "ephemeral"},
                               "output_config": {"effort": "low", "format": {"type": "json_schema",
                                                                              "schema": {"type": "object"}}}})
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                                "description": "weather"}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False and chat["stop"] == ["END"]
    assert (chat["top_k"], chat["temperature"], chat["num_draft_tokens"]) == (5, 0.5, 3)
    assert chat["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False} and chat["reasoning_effort"] == "low"
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert not {"metadata", "cache_control", "output_config", "thinking", "stop_sequences"} & set(chat)
    named = messages.chat_body({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                "tools": [tool], "tool_choice": {"type": "tool", "name": "w"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    strict = messages.chat_body({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                 "tools": [{**tool, "strict": True}]})  # Anthropic's strict tool use
    assert strict["tools"][0]["function"]["strict"] is True
    counted = messages.chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}]}, count=True)
    assert counted["max_tokens"] == 1  # count_tokens takes no max_tokens


def test_a_thinking_budget_is_the_chats_where_the_server_reads_the_thinking():
    """thinking.budget_tokens becomes the chat's thinking_token_budget with a reasoning parser (which enforces
    it); without one the template's enable_thinking only, as before."""
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert messages.chat_body(body, budgets=True)["thinking_token_budget"] == 1024
    assert "thinking_token_budget" not in messages.chat_body(body)
    assert "thinking_token_budget" not in messages.chat_body({**body, "thinking": {"type": "adaptive"}}, budgets=True)
    gen = parse_chat(messages.chat_body(body, budgets=True), SERVED, reasoning_parser="qwen3")
    assert gen.choices[0][tn.THINKING_TOKEN_BUDGET][0, 0] == 1024 and gen.choices[0][tn.REASONING_PARSER][0, 0] == b"qwen3"
    # DeepSeek-V3.1's template reads `thinking`: its parser thinks where the template opened the block
    gen = parse_chat(messages.chat_body(body, budgets=True), SERVED, reasoning_parser="deepseek_v3")
    assert gen.reasoning == "deepseek_r1" and gen.choices[0][tn.THINKING_TOKEN_BUDGET][0, 0] == 1024


@pytest.mark.parametrize("body, named", [
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "thinking_token_budget": 8},
     "thinking_token_budget")])
def test_an_explicit_budget_without_a_reasoning_parser_is_refused(body, named):
    with pytest.raises(ApiError) as caught:
        parse_chat(messages.chat_body({"model": "m", **body}), SERVED)
    assert caught.value.status == 400 and caught.value.param == named


@pytest.mark.parametrize("body, named", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 2, "messages": []}, "messages"),
    ({"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n",
                                                                   "input": {}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": 2, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 2, "system": 3, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124"}]},
     "tools.0.type"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "w"}],
      "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "max"}}, "thinking.type"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []}, "mcp_servers")])
def test_refusals_name_the_messages_field(body, named):
    with pytest.raises(ApiError) as caught:
        messages.chat_body({"model": "m", **body})
    assert caught.value.status == 400 and caught.value.message.startswith(named)
    error = messages.error_body(caught.value)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"


def test_errors_about_the_chats_fields_name_the_messages_fields_and_statuses_their_types():
    assert messages.renamed(ApiError(400, "stop: too many", "stop")).message == "stop_sequences: too many"
    assert messages.renamed(ApiError(400, "x", "temperature")).param == "temperature"
    kinds = {status: messages.error_body(ApiError(status, "m"))["error"]["type"] for status in (401, 404, 429, 500, 503)}
    assert kinds == {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 500: "api_error",
                     503: "overloaded_error"}


def test_the_message_its_blocks_and_its_stop_reasons():
    gen = parse_chat(messages.chat_body({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
                     SERVED)
    blocks = messages.content_blocks("Hi", [{"name": "w", "arguments": '{"city": "Oslo"}'}], thinking="hm")
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2]["input"] == {"city": "Oslo"} and blocks[2]["id"].startswith("toolu_")
    assert messages.content_blocks("", [{"name": "w", "arguments": '{"ci'}])[0]["input"] == {"_partial_arguments": '{"ci'}
    body = messages.message_object(gen, blocks, "tool_use", None, messages.usage(37, 7, cached_tokens=32),
                                   {"num_rounds": 3})
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    # the prompt's 37 tokens: 32 read from the prefix cache, 5 input (Anthropic's fields add up to the prompt)
    assert body["usage"] == {"input_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32,
                             "output_tokens": 7} and body["speculative_decoding"]["num_rounds"] == 3
    assert messages.stop_reason("stop", True, None) == "tool_use"
    assert messages.stop_reason("length", False, None) == "max_tokens"
    assert messages.stop_reason("stop", False, "END") == "stop_sequence"
    assert messages.stop_reason("stop", False, None) == "end_turn"
    # which sequence stopped it: the earliest found in the generated text after what was sent
    assert messages.matched_stop("abc END xyz STOP", "abc ", ["STOP", "END"]) == "END"
    assert messages.matched_stop("abc", "abc", ["END"]) is None and messages.matched_stop("a", "a", None) is None
    raw = messages.event("content_block_delta", index=0, delta={"type": "text_delta", "text": "é"}).decode()
    assert raw.startswith("event: content_block_delta\ndata: ") and raw.endswith("\n\n")
    assert json.loads(raw.split("data: ", 1)[1])["delta"]["text"] == "é"
    # text with the characters str.splitlines() breaks at (requests' iter_lines(decode_unicode=True) does) stays
    # on its data line, and the same text
    odd = "a\u2028b\x85c\u2029d"
    raw = messages.event("content_block_delta", index=0, delta={"type": "text_delta", "text": odd}).decode()
    assert raw.splitlines() == raw.split("\n")[:-1]
    assert json.loads(raw.splitlines()[1].removeprefix("data: "))["delta"]["text"] == odd


def test_a_prefilled_answer_is_continued():
    """Anthropic's prefill: an assistant message last is the answer's beginning, continued (not answered); one
    that called a tool is a turn like any other."""
    prefilled = messages.chat_body({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "JSON please"}, {"role": "assistant", "content": [{"type": "text", "text": "{"}]}]})
    assert (prefilled["continue_final_message"], prefilled["add_generation_prompt"]) == (True, False)
    assert prefilled["messages"][-1] == {"role": "assistant", "content": "{"}
    gen = parse_chat(prefilled, SERVED)
    assert gen.choices[0][tn.CONTINUE_FINAL_MESSAGE].tolist() == [[True]]
    asked = messages.chat_body({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    assert "continue_final_message" not in asked
