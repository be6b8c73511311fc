"""gpt-oss's harmony answers read apart (gateway/harmony.py, the reasoning parser openai_gptoss and the tool-call
parser openai): thinking, content and calls, whole and streamed at every split, as the OpenAI API sends them."""

import json

import pytest

from specdec import tensor_names as tn
from specdec.gateway import harmony, protocol, reasoning, tools
from specdec.gateway.tools import AUTO, ToolCalling

THINK = "<|channel|>analysis<|message|>The user wants Oslo's weather. Call get_weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo."
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
CALLING = ToolCalling(AUTO, ("get_weather", "get_time"), "openai")

ANSWERS = {  # answer text -> (thinking, content after the reasoning parser, content and calls after the tool parser)
    "think-final": (THINK + FINAL, "The user wants Oslo's weather. Call get_weather.", "It is sunny in Oslo.", []),
    "think-call": (THINK + CALL, "The user wants Oslo's weather. Call get_weather.", None,
                   [("get_weather", {"city": "Oslo"})]),
    "preamble-call": (THINK + PREAMBLE + CALL, "The user wants Oslo's weather. Call get_weather.", "Let me check.",
                      [("get_weather", {"city": "Oslo"})]),
    # the recipient before the channel, no analysis, two calls (the second ended by its end token, kept)
    "calls": (' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
              '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}',
              "", None, [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    # gpt-oss's built-in browser is none of the request's tools
    "browser": (THINK + '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}',
                "The user wants Oslo's weather. Call get_weather.", None, []),
    "plain": ("Plain text, no channels <b>.", "", "Plain text, no channels <b>.", []),  # a structured output's
    "cut": ("<|channel|>analysis<|message|>Still thinking", "Still thinking", None, []),  # cut by max_tokens
}


@pytest.mark.parametrize("name", ANSWERS)
def test_thinking_content_and_calls_are_read_apart_whole_and_streamed_at_every_split(name):
    text, thinking, content, calls = ANSWERS[name]
    got_thinking, passed_on = reasoning.split(text, reasoning.HARMONY)
    assert (got_thinking or "") == thinking
    got_content, found = tools.split_output(passed_on or "", CALLING)
    assert (got_content or None) == content
    assert [(call["name"], json.loads(call["arguments"])) for call in found] == calls
    for i in range(len(text) + 1):  # every split into two deltas gives the same parts
        for j in range(i, len(text) + 1, 7):
            stream = reasoning.ReasoningStream(reasoning.HARMONY)
            parts = [stream.feed(text[:i]), stream.feed(text[i:j]), stream.feed(text[j:]), stream.finish()]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (thinking, passed_on or ""), (i, j)


def test_streamed_content_stops_where_a_call_opens_and_the_calls_come_at_the_end():
    text = THINK + PREAMBLE + CALL
    thinker, caller = reasoning.ReasoningStream(reasoning.HARMONY), tools.ToolStream(CALLING)
    content, deltas = [], []
    for k in range(0, len(text), 5):
        _, passed = thinker.feed(text[k:k + 5])
        out, more = caller.feed(passed)
        content.append(out)
        deltas += more
    _, passed = thinker.finish()
    out, more = caller.feed(passed)
    rest, last, called = caller.finish()
    assert "".join(content) + out + rest == "Let me check." and called
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas + more + last] == [
        ("get_weather", {"city": "Oslo"})]


def test_the_thinking_ends_after_the_analysis_messages_it_opens_with():
    assert harmony.thinking_end(THINK + FINAL) == len(THINK)
    two = THINK + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>"
    assert harmony.thinking_end(two + FINAL) == len(two)
    assert harmony.thinking_end(FINAL) == 0 and harmony.thinking_end("plain") == 0
    assert harmony.thinking_end(THINK[:-len("<|end|>")]) == len(THINK) - len("<|end|>")  # cut short: all of it
    assert reasoning.thinking_end(THINK + FINAL, reasoning.HARMONY) == len(THINK)


def test_the_openai_tool_parser_implies_gpt_oss_channels_and_refuses_other_thinking():
    assert tools.reasoning_for("openai", None) == tools.reasoning_for("openai", "openai_gptoss") == "openai_gptoss"
    assert tools.reasoning_for("hermes", "qwen3") == "qwen3" and tools.reasoning_for(None, None) is None
    with pytest.raises(ValueError, match="--reasoning-parser must be openai_gptoss"):
        tools.reasoning_for("openai", "deepseek_r1")


def test_requests_keep_special_tokens_and_gate_a_structured_output_and_a_budget_on_the_final_channel():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    plain = protocol.parse_chat(chat, ("m",), reasoning_parser="openai_gptoss")
    assert plain.sampling["skip_special_tokens"] is False  # the channels are special tokens
    assert tn.REASONING_PARSER not in plain.choices[0]  # (nothing to gate)
    forced = protocol.parse_chat({**chat, "response_format": {"type": "json_object"}}, ("m",),
                                 reasoning_parser="openai_gptoss")
    assert forced.choices[0][tn.REASONING_PARSER].tolist() == [[b"openai_gptoss"]]  # the server gates the guide
    budget = protocol.parse_chat({**chat, "thinking_token_budget": 10}, ("m",), reasoning_parser="openai_gptoss")
    assert budget.choices[0][tn.THINKING_TOKEN_BUDGET].tolist() == [[10]]
    assert budget.choices[0][tn.REASONING_PARSER].tolist() == [[b"openai_gptoss"]]
    assert "skip_special_tokens" not in protocol.parse_chat(chat, ("m",), reasoning_parser="qwen3").sampling
