"""The OpenAI-compatible API (`specdec.gateway`, started by the launcher beside the session's server) through
the official `openai` SDK: chat and completions, sync, async and streamed, against the ensemble called
directly over gRPC with the same settings; structured output, log-probabilities, errors, API keys and
clients that go away."""

import asyncio
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import anthropic
import numpy as np
import openai
import pytest

from specdec import tensor_names as tn
from specdec.serving import metrics_text
from specdec.serving.healthcheck import answers, gateway_url
from specdec.serving.pairs import TINY_LORA, TINY_LORA_LIBRARY

from .helpers import GenerationError, ensemble_inputs, grpc_stream, own_gateway, run_bench

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def api(server):
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(api):
    return api.models.list().data[0].id


def _messages_stream(server, messages, **params) -> dict:
    """The ensemble called directly with the chat as its `messages` input (what the gateway sends)."""
    return grpc_stream(server.grpc_url, None, messages=json.dumps(messages), **params)


def test_models_health_and_an_unknown_model(server, api, model):
    assert answers(gateway_url(server.openai_port), 5)
    # the served model, then the session's LoRA adapter (a model of its own name, its parent the served one)
    assert [m.id for m in api.models.list().data] == [model, TINY_LORA, *TINY_LORA_LIBRARY] and api.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4)


def test_chat_equals_the_ensemble_and_streams_as_openai_does(server, api, model):
    """Greedy chat, whole and streamed: the text equals the ensemble's for the same chat; one id, the role
    first, usage only in the last chunk (choices empty), the statistics with the finish."""
    # A fixed K: the adaptive one picks each round's k from measured timings, so two runs' rounds may differ
    direct = _messages_stream(server, CHAT, max_tokens=24, num_draft_tokens=3, temperature=0.0, adaptive_draft=False)
    calls = {name: server.metric("nv_inference_request_success", model=name)
             for name in (tn.ENSEMBLE, tn.PREPROCESSING, tn.SPECULATIVE_DECODING, tn.POSTPROCESSING)}
    whole = api.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0,  # vLLM's priority:
                                        extra_body={"num_draft_tokens": 3, "adaptive_draft": False, "priority": 7})
    assert whole.choices[0].message.content == direct[tn.TEXT_OUTPUT]
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == direct[tn.FINISH_REASON] == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (direct[tn.NUM_INPUT_TOKENS], 24)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    stats = whole.model_extra["speculative_decoding"]
    assert stats["num_rounds"] == direct[tn.NUM_ROUNDS] and stats["total_draft_tokens"] > 0

    chunks = list(api.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"num_draft_tokens": 3}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct[tn.TEXT_OUTPUT]
    assert len(chunks) > 3  # streamed round by round, not in one piece
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    # The launcher's API calls preprocessing, then speculative_decoding (--upstream direct): no ensemble, and no
    # postprocessing step for each of the stream's responses
    expected = {tn.ENSEMBLE: 0, tn.PREPROCESSING: 2, tn.SPECULATIVE_DECODING: 2, tn.POSTPROCESSING: 0}
    deadline = time.monotonic() + 10  # Triton counts a decoupled request once it is released, just after its end
    while True:
        now = {name: server.metric("nv_inference_request_success", model=name) - calls[name] for name in calls}
        if now == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert now == expected


def test_completions_sync_async_and_streamed_equal_the_ensemble(server, api, model):
    direct = grpc_stream(server.grpc_url, PROMPT, max_tokens=20, num_draft_tokens=4, temperature=0.0,
                         draft_model="draft_model")
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                   extra_body={"num_draft_tokens": 4, "draft_model": "draft_model"})
    assert whole.choices[0].text == direct[tn.TEXT_OUTPUT] and whole.object == "text_completion"
    assert whole.usage.prompt_tokens == direct[tn.NUM_INPUT_TOKENS]
    streamed = api.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct[tn.TEXT_OUTPUT]
    # stream_interval (tokens, SGLang's name): the same text in fewer chunks, the first at once (target-only:
    # a round's token a chunk otherwise)
    chunks = {}
    for interval in (1, 8):
        stream = api.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                        extra_body={"stream_interval": interval, "num_draft_tokens": 0})
        chunks[interval] = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
        assert "".join(chunks[interval]) == direct[tn.TEXT_OUTPUT]
    assert len(chunks[8]) <= 20 // 8 + 2 < len(chunks[1])

    async def concurrently():
        async with openai.AsyncOpenAI(base_url=server.openai_url, api_key="unused", max_retries=0) as client:
            async def one():
                stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                                         stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            return await asyncio.gather(*[one() for _ in range(4)])

    assert asyncio.run(concurrently()) == [direct[tn.TEXT_OUTPUT]] * 4


def test_sampling_settings_reach_the_ensemble(server, api, model):
    """A seeded sampled request with OpenAI's and vLLM's settings gives the ensemble's text for the same
    settings given as vLLM's `sampling_parameters` (so each setting arrived), and OpenAI's default
    temperature (1) samples."""
    settings = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 11, "presence_penalty": 0.5,
                "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_p": 0.01}
    direct = grpc_stream(server.grpc_url, PROMPT, max_tokens=16, num_draft_tokens=2, adaptive_draft=False,
                         sampling_parameters=json.dumps(settings))
    out = api.completions.create(model=model, prompt=PROMPT, max_tokens=16, **{k: settings[k] for k in
                                 ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")},
                                 extra_body={"top_k": 40, "repetition_penalty": 1.2, "min_p": 0.01,
                                             "num_draft_tokens": 2, "adaptive_draft": False,
                                             # (vLLM's, as clients written for it send them: at their defaults)
                                             "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
                                             "add_special_tokens": True})
    assert out.choices[0].text == direct[tn.TEXT_OUTPUT]
    greedy = api.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    sampled = {api.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=s).choices[0].text
               for s in range(3)}
    assert sampled != {greedy} and len(sampled) > 1


def test_stop_logit_bias_and_length_finish(server, api, model):
    base = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    word = base.split()[2]
    stopped = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[word])
    assert stopped.choices[0].text == base[:base.index(word)] and stopped.choices[0].finish_reason == "stop"
    biased = api.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={"42": 100})
    assert biased.choices[0].text == grpc_stream(server.grpc_url, PROMPT, max_tokens=4, temperature=0.0,
                                                 sampling_parameters=json.dumps({"logit_bias": {"42": 100}}))[tn.TEXT_OUTPUT]


def test_prompts_as_token_ids(server, api, model):
    """A completions prompt of token ids (what lm-eval's local-completions sends) answers as its text does
    (the tiny pair applies no chat template to a text prompt); the ensemble takes them as prompt_token_ids."""
    from transformers import AutoTokenizer

    from specdec.serving.pairs import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    ids = tokenizer(PROMPT).input_ids
    text = api.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    by_ids = api.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    several = api.completions.create(model=model, prompt=[ids, ids[:4]], max_tokens=6, temperature=0)
    assert several.choices[0].text == text.choices[0].text[:len(several.choices[0].text)]
    assert several.usage.prompt_tokens == len(ids) + 4
    direct = grpc_stream(server.grpc_url, None, prompt_token_ids=np.array([ids], dtype=np.int32), max_tokens=10,
                         temperature=0.0)
    assert direct[tn.TEXT_OUTPUT] == text.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt=[10**8], max_tokens=2)
    # (named as the request's field, as the server checked it: its ids' range)
    assert caught.value.body["param"] == "prompt" and caught.value.body["message"].startswith(
        "prompt must hold token ids within [0, 49152)")
    with pytest.raises(GenerationError, match="exclude each other"):
        grpc_stream(server.grpc_url, PROMPT, prompt_token_ids=np.array([ids], dtype=np.int32), max_tokens=2)


def test_return_token_ids_are_the_tokens_the_model_read_and_wrote(api, model):
    """vLLM's return_token_ids (what reinforcement-learning trainers send, to train on exactly the tokens
    served): a chat's prompt_token_ids are its chat template's tokens and each choice's token_ids its
    answer's, whole and streamed alike; a completion's are on each choice, an echo's token_ids starting with
    the prompt's; a value that is not a boolean is refused naming the field."""
    from specdec.decoding.text import chat_ids, load_tokenizer
    from specdec.serving.pairs import smollm2_tokenizer_dir

    tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()))
    chat_prompt, text_prompt = chat_ids(tokenizer, CHAT, None, "messages"), tokenizer(PROMPT).input_ids
    asked = {"return_token_ids": True, "ignore_eos": True}
    whole = api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, n=2,
                                        extra_body=asked).model_dump()
    assert whole["prompt_token_ids"] == chat_prompt and whole["usage"]["prompt_tokens"] == len(chat_prompt)
    answer = whole["choices"][0]["token_ids"]
    assert len(answer) == 8 and tokenizer.decode(answer) == whole["choices"][0]["message"]["content"]
    assert whole["choices"][1]["token_ids"] == answer  # greedy: both choices alike
    chunks = [chunk.model_dump() for chunk in api.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True, extra_body=asked)]
    assert chunks[0]["prompt_token_ids"] == chat_prompt and "prompt_token_ids" not in chunks[1]
    assert [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids") or []] == answer
    plain = api.chat.completions.create(model=model, messages=CHAT, max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body=asked).model_dump()["choices"][0]
    assert completion["prompt_token_ids"] == text_prompt and len(completion["token_ids"]) == 6
    assert tokenizer.decode(completion["token_ids"]) == completion["text"]
    streamed = [chunk.model_dump()["choices"] for chunk in api.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, extra_body=asked)]
    assert streamed[0][0]["prompt_token_ids"] == text_prompt
    assert [t for choices in streamed for c in choices for t in c.get("token_ids") or []] == completion["token_ids"]
    echoed = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                    extra_body=asked).model_dump()["choices"][0]
    assert echoed["token_ids"] == text_prompt + completion["token_ids"]
    assert echoed["text"] == PROMPT + completion["text"]
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"return_token_ids": "yes"})
    assert caught.value.body["param"] == "return_token_ids"

    # return_tokens_as_token_ids: log-probabilities name those very tokens (and the most likely ones) by id
    named = {**asked, "return_tokens_as_token_ids": True}
    out = api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=2, extra_body=named).model_dump()["choices"][0]
    assert [e["token"] for e in out["logprobs"]["content"]] == [f"token_id:{t}" for t in answer]
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in out["logprobs"]["content"])
    assert b"".join(bytes(e["bytes"]) for e in out["logprobs"]["content"]).decode() == out["message"]["content"]
    text = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                  extra_body=named).model_dump()["choices"][0]
    assert text["logprobs"]["tokens"] == [f"token_id:{t}" for t in completion["token_ids"]]
    widths = [len(tokenizer.decode([t])) for t in completion["token_ids"]]
    assert text["logprobs"]["text_offset"] == [sum(widths[:i]) for i in range(6)]  # the text's, still


def test_a_request_id_names_the_answer_and_comes_back_in_its_header(api, model):
    """vLLM's request ids: an X-Request-Id header (or else the body's request_id) is the answer's id after its
    prefix and its X-Request-Id, streamed or not; an answer without one gets a new id in both; a bad id is
    refused naming where it came from."""
    raw = api.chat.completions.with_raw_response.create(model=model, messages=CHAT, max_tokens=2,
                                                        extra_headers={"X-Request-Id": "trace-7f3a"})
    assert raw.parse().id == "chatcmpl-trace-7f3a" and raw.headers["x-request-id"] == "trace-7f3a"
    raw = api.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=2,
                                                   extra_body={"request_id": "batch-12"})
    assert raw.parse().id == "cmpl-batch-12" and raw.headers["x-request-id"] == "batch-12"
    with api.chat.completions.with_streaming_response.create(
            model=model, messages=CHAT, max_tokens=3, stream=True, extra_headers={"X-Request-Id": "s-1"}) as stream:
        assert stream.headers["x-request-id"] == "s-1"
        assert {chunk.id for chunk in stream.parse()} == {"chatcmpl-s-1"}
    raw = api.chat.completions.with_raw_response.create(model=model, messages=CHAT, max_tokens=2)
    assert raw.parse().id == "chatcmpl-" + raw.headers["x-request-id"]
    for given in ({"extra_body": {"request_id": ""}}, {"extra_body": {"request_id": 7}}):
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=2, **given)
        assert caught.value.body["param"] == "request_id"


def test_n_choices_and_lists_of_prompts(server, api, model):
    """Several choices: every prompt's n choices, indexed as OpenAI does; greedy ones equal the single
    answer, seeded sampled ones the ensemble's with seed + j (streamed, each chunk naming its choice); a
    prompt's tokens counted once in the usage."""
    second = "The recipe calls for"
    single = [api.completions.create(model=model, prompt=p, max_tokens=10, temperature=0) for p in (PROMPT, second)]
    many = api.completions.create(model=model, prompt=[PROMPT, second], n=2, max_tokens=10, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [single[0].choices[0].text] * 2 + [single[1].choices[0].text] * 2
    assert many.usage.prompt_tokens == single[0].usage.prompt_tokens + single[1].usage.prompt_tokens
    assert many.usage.completion_tokens == 2 * (single[0].usage.completion_tokens + single[1].usage.completion_tokens)
    assert many.model_extra["speculative_decoding"]["num_rounds"] >= 4

    speculation = {"num_draft_tokens": 2, "adaptive_draft": False}
    direct = [_messages_stream(server, CHAT, max_tokens=16, **speculation,
                               sampling_parameters=json.dumps({"temperature": 0.9, "seed": 5 + j}))[tn.TEXT_OUTPUT]
              for j in range(3)]
    assert len(set(direct)) > 1  # the seeds differ, so do the answers
    whole = api.chat.completions.create(model=model, messages=CHAT, n=3, seed=5, temperature=0.9, max_tokens=16,
                                        extra_body=speculation)
    assert [c.message.content for c in whole.choices] == direct and [c.index for c in whole.choices] == [0, 1, 2]
    chunks = list(api.chat.completions.create(model=model, messages=CHAT, n=3, seed=5, temperature=0.9, max_tokens=16,
                                              stream=True, stream_options={"include_usage": True}, extra_body=speculation))
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    assert ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == j)
            for j in range(3)] == direct
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_choices_refused_or_cancelled_together(server, api, model):
    """A refusal of the server's with n > 1 is one 400 naming the field; a client that goes away from a
    stream of three choices cancels all three on the server."""
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=model, messages=CHAT, n=2, max_tokens=4, extra_body={"draft_model": "nope"})
    assert caught.value.body["param"] == "draft_model"
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    _settled_cancelled(server, before, 0)
    _leave_a_stream(api, model, chunks=6, n=3)
    _settled_cancelled(server, before, 3)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_by_name_or_required_whole_and_streamed(api, model):
    """A named function and "required" constrain the answer to the tools' schemas (any model calls them):
    the calls come back as OpenAI's SDK types them, streamed deltas adding up to the whole answer's; a
    conversation carrying calls and their results is taken."""
    named = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = api.chat.completions.create(model=model, messages=CHAT, max_tokens=48, temperature=0, **named)
    message = whole.choices[0].message
    assert message.content is None and whole.choices[0].finish_reason == "stop" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    chunks = list(api.chat.completions.create(model=model, messages=CHAT, max_tokens=48, temperature=0, stream=True,
                                              **named))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_") and len(deltas) > 1
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments

    required = api.chat.completions.create(model=model, messages=CHAT, max_tokens=64, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time") and isinstance(json.loads(calls[0].function.arguments), dict)

    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "20 C and sunny"}]
    answer = api.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0, tools=[WEATHER],
                                         tool_choice="none")
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as caught:  # auto needs a parser of the model's format
        api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, tools=[WEATHER])
    assert caught.value.body["param"] == "tool_choice"


def test_auto_tool_calls_are_read_in_the_models_format(server, model):
    """A gateway started with --tool-call-parser hermes reads calls the model writes itself (here the
    answer is forced to one, with vLLM's guided_choice): content before it, the call after, whole and
    streamed."""
    with own_gateway(server, model, "--tool-call-parser", "hermes") as port:
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        forced = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        args = {"model": model, "messages": CHAT, "max_tokens": 64, "temperature": 0, "tools": [WEATHER],
                "extra_body": {"guided_choice": [forced]}}
        whole = client.chat.completions.create(**args)
        message = whole.choices[0].message
        assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        chunks = list(client.chat.completions.create(stream=True, **args))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in calls] == [("get_weather", '{"city": "Paris"}')]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
        plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0, tools=[WEATHER])
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content  # no call: text
        # a strict tool: its calls held to its schema by structural tags (tools.strict_call_tags), the text
        # around them free: an answer that calls nothing is the same text
        strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
        held = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0, tools=[strict])
        assert held.choices[0].message.content == plain.choices[0].message.content
        # The Responses API, streamed: the content as it comes (its text deltas end before the call's item
        # opens), then the call's item; and with tools but no call, the text streamed round by round
        tool = {"type": "function", **WEATHER["function"]}
        with client.responses.stream(model=model, input=CHAT, tools=[tool], max_output_tokens=64, temperature=0,
                                     extra_body={"guided_choice": [forced]}) as stream:
            events = list(stream)
            built = stream.get_final_response()
        kinds = [e.type for e in events]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking."
        assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
        assert [item.type for item in built.output] == ["message", "function_call"]
        assert (built.output[1].name, json.loads(built.output[1].arguments)) == ("get_weather", {"city": "Paris"})
        text = [e.delta for e in client.responses.create(model=model, input=CHAT, tools=[tool], max_output_tokens=12,
                                                          temperature=0, stream=True)
                if e.type == "response.output_text.delta"]
        assert len(text) > 1 and "".join(text).startswith(plain.choices[0].message.content)


def test_mistral_tool_calls_are_read_with_special_tokens_kept_and_mistrals_ids(server, model):
    """A gateway started with --tool-call-parser mistral: a [TOOL_CALLS] answer (forced, with vLLM's
    guided_choice) becomes content and calls with 9-character ids, whole and streamed; the server is asked to
    keep special tokens in the text (a forced <|im_start|>, a special token of this tokenizer, shows in the
    content); a conversation sending the call and its result back is taken."""
    with own_gateway(server, model, "--tool-call-parser", "mistral") as port:
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        forced = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        args = {"model": model, "messages": CHAT, "max_tokens": 64, "temperature": 0, "tools": [WEATHER],
                "extra_body": {"guided_choice": [forced]}}
        whole = client.chat.completions.create(**args)
        message = whole.choices[0].message
        assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert len(call.id) == 9 and call.id.isalnum()
        chunks = list(client.chat.completions.create(stream=True, **args))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", '{"city": "Paris"}')]
        assert len(deltas[0].id) == 9
        special = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                                 tools=[WEATHER], logit_bias={"1": 100})  # 1: <|im_start|>
        assert special.choices[0].message.content == "<|im_start|>" * 3
        history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "20 C and sunny"}]
        answer = client.chat.completions.create(model=model, messages=history, max_tokens=6, temperature=0,
                                                tools=[WEATHER], tool_choice="none")
        assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_qwen3_coder_calls_reach_an_anthropic_client_as_tool_use_blocks_of_typed_input(server, model):
    """A gateway started with --tool-call-parser qwen3_coder (Qwen3-Coder's XML calls, e.g. under Claude Code):
    a call the model writes (forced, with vLLM's guided_choice) reaches Anthropic's SDK as a tool_use block
    whose input has the schema's types, the text before it a text block; and OpenAI's SDK reads the same."""
    forecast = {"name": "get_forecast", "description": "The weather in a city for some days", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}}, "required": ["city", "days"]}}
    forced = ("Checking.\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nSan Jose\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")
    with own_gateway(server, model, "--tool-call-parser", "qwen3_coder") as port:
        claude = anthropic.Anthropic(base_url=f"http://localhost:{port}", api_key="x", max_retries=0)
        called = claude.messages.create(model=model, max_tokens=96, tools=[forecast],
                                        messages=[{"role": "user", "content": "Weather in San Jose?"}],
                                        extra_body={"temperature": 0, "guided_choice": [forced]})
        text, use = called.content
        assert (text.type, text.text, called.stop_reason) == ("text", "Checking.", "tool_use")
        assert (use.type, use.name, use.input) == ("tool_use", "get_forecast",
                                                   {"city": "San Jose", "days": 3, "metric": True})
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        tool = {"type": "function", "function": {"name": forecast["name"], "parameters": forecast["input_schema"]}}
        chunks = list(client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=96, temperature=0, tools=[tool], stream=True,
            extra_body={"guided_choice": [forced]}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking.\n"
        (delta,) = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert json.loads(delta.function.arguments) == {"city": "San Jose", "days": 3, "metric": True}


@pytest.mark.parametrize("parser, forced", [
    ("deepseek_v31", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi_k2", 'Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
    ("glm45", "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
])
def test_deepseek_kimi_and_glm_calls_are_read_whole_and_streamed(server, model, parser, forced):
    """Gateways started with --tool-call-parser deepseek_v31, kimi_k2 and glm45 (as vLLM serves those models):
    a call the model writes (forced, with vLLM's guided_choice) becomes content and the call, whole and
    streamed (Kimi's own id kept); the server keeps special tokens for them."""
    with own_gateway(server, model, "--tool-call-parser", parser, "--enable-auto-tool-choice") as port:
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        args = {"model": model, "messages": CHAT, "max_tokens": 96, "temperature": 0, "tools": [WEATHER],
                "extra_body": {"guided_choice": [forced]}}
        whole = client.chat.completions.create(**args).choices[0]
        assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"
        (call,) = whole.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert (call.id == "functions.get_weather:0") == (parser == "kimi_k2")
        chunks = list(client.chat.completions.create(stream=True, **args))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
        (delta,) = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert (delta.function.name, json.loads(delta.function.arguments)) == ("get_weather", {"city": "Paris"})
        special = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0,
                                                 tools=[WEATHER], logit_bias={"1": 100})  # 1: <|im_start|>
        assert special.choices[0].message.content == "<|im_start|>" * 2


def test_a_reasoning_parser_puts_the_thinking_apart(server, model):
    """A gateway started with --reasoning-parser qwen3 (and hermes tool calls): the thinking a model writes
    between <think> and </think> (here forced, with vLLM's guided_choice: SmolLM2's tokenizer spells <think>
    with three tokens, so qwen3's guide holds from the first one) comes as reasoning_content and
    reasoning, the answer as content, whole and streamed; a tool call is read from the answer only (not from
    a thinking that mentions one); include_reasoning false leaves it out. chat_template_kwargs reach the
    server's preprocessing (which refuses a name it sets itself, named as the request's field)."""
    from specdec.serving.pairs import smollm2_tokenizer_dir

    with own_gateway(server, model, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                     "--tokenizer", str(smollm2_tokenizer_dir())) as port:  # the tokenizer counts thinking tokens
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        forced = "<think>\nThree colours, <tool_call> not needed.\n</think>\n\nRed, green, blue."
        args = {"model": model, "messages": CHAT, "max_tokens": 64, "temperature": 0, "tools": [WEATHER],
                "extra_body": {"guided_choice": [forced], "chat_template_kwargs": {"enable_thinking": True}}}
        whole = client.chat.completions.create(**args)
        message = whole.choices[0].message
        assert message.content == "\n\nRed, green, blue." and message.tool_calls is None
        # usage counts the thinking block's tokens apart, as OpenAI and vLLM report them
        thought = whole.usage.completion_tokens_details.reasoning_tokens
        assert 10 < thought < whole.usage.completion_tokens
        assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == \
            "\nThree colours, <tool_call> not needed.\n"
        every = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        assert every[-1].usage.completion_tokens_details.reasoning_tokens == thought
        chunks = [c.choices[0] for c in every if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == message.content
        thinking = [c.delta.model_extra.get("reasoning_content") or "" for c in chunks]
        assert "".join(thinking) == message.model_extra["reasoning_content"] and sum(map(bool, thinking)) > 1
        assert all(c.delta.model_extra.get("reasoning_content") == c.delta.model_extra.get("reasoning") for c in chunks)
        called = "<think>Weather needed.</think><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>"
        out = client.chat.completions.create(**{**args, "extra_body": {"guided_choice": [called]}}).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.model_extra["reasoning_content"] == "Weather needed."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == [
            ("get_weather", {"city": "Oslo"})]
        # The Responses API: the thinking as a reasoning item before the message, whole and streamed, and
        # sent back in the next request's input (as clients replay an output)
        rargs = {"model": model, "input": CHAT, "max_output_tokens": 64, "temperature": 0,
                 "extra_body": {"guided_choice": [forced]}}
        built = client.responses.create(**rargs)
        assert [item.type for item in built.output] == ["reasoning", "message"] and built.output_text == message.content
        assert built.output[0].content[0].text == message.model_extra["reasoning_content"]
        with client.responses.stream(**rargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
        streamed = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(streamed) == message.model_extra["reasoning_content"] and len(streamed) > 1
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == message.content
        assert [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"] == [
            (0, "reasoning"), (1, "message")]
        assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
        assert [(item.type, item.content[0].text) for item in final.output] == [
            (item.type, item.content[0].text) for item in built.output]
        assert built.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens_details.reasoning_tokens \
            == thought
        replayed = [*CHAT, *(item.model_dump(exclude_none=True) for item in built.output),
                    {"role": "user", "content": "And two more?"}]
        assert client.responses.create(model=model, input=replayed, max_output_tokens=3).status == "incomplete"
        # OpenAI's reasoning effort is a variable of the chat template (SmolLM2's leaves it unused)
        assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                              reasoning_effort="low").choices[0].finish_reason == "length"
        assert client.responses.create(model=model, input=CHAT, max_output_tokens=2,
                                       reasoning={"effort": "high"}).reasoning.effort == "high"
        hidden = client.chat.completions.create(**{**args, "extra_body": {"guided_choice": [forced],
                                                                          "include_reasoning": False}})
        assert hidden.choices[0].message.content == message.content
        assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
        assert caught.value.body["param"] == "chat_template_kwargs" and "set by the server" in caught.value.body["message"]
        # vLLM's documents: the template's sources (SmolLM2's renders none: the same answer), checked by the server
        plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0)
        sourced = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                                 extra_body={"documents": [{"title": "t", "text": "x"}]})
        assert sourced.choices[0].message.content == plain.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"documents": [1]}})
        assert caught.value.body["param"] == "chat_template_kwargs" and "documents" in caught.value.body["message"]


def test_a_reasoning_models_structured_output_constrains_only_its_answer(server, api, model):
    """With --reasoning-parser deepseek_r1 the output thinks until </think> and a response_format holds after
    it: the tiny model never closes its thinking, so its answer is its unconstrained text, all thinking,
    streamed alike; the same request without the parser is JSON from the first token."""
    args = {"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    with own_gateway(server, model, "--reasoning-parser", "deepseek_r1") as port:
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        plain = client.chat.completions.create(**args).choices[0].message
        assert plain.content is None and plain.model_extra["reasoning_content"]
        constrained = client.chat.completions.create(**args, response_format={"type": "json_object"}).choices[0]
        assert constrained.message.content is None and constrained.finish_reason == "length"
        assert constrained.message.model_extra["reasoning_content"] == plain.model_extra["reasoning_content"]
        chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True,
                                                                       response_format={"type": "json_object"})
                  if c.choices]
        assert "".join(c.delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
            plain.model_extra["reasoning_content"] and not any(c.delta.content for c in chunks)
    answer = api.chat.completions.create(**args, response_format={"type": "json_object"}).choices[0].message.content
    assert answer.startswith("{") and not plain.model_extra["reasoning_content"].startswith("{")


def test_a_thinking_budget_closes_the_thinking_and_the_answer_follows(server, api, model, claude):
    """thinking_token_budget (vLLM's; Anthropic's thinking.budget_tokens) with --reasoning-parser deepseek_r1:
    the tiny model, which never closes its thinking itself, thinks its own first 5 tokens, the server forces
    </think>, and its answer follows; speculative and target-only decoding give the same; without the parser
    the field is refused by name."""
    args = {"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    with own_gateway(server, model, "--reasoning-parser", "deepseek_r1") as port:
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        free = client.chat.completions.create(**args).choices[0].message.model_extra["reasoning_content"]
        budgeted = [client.chat.completions.create(**args, extra_body={"thinking_token_budget": 5, "num_draft_tokens": k})
                    for k in (0, 4)]
        assert budgeted[0].choices[0].message == budgeted[1].choices[0].message
        message = budgeted[0].choices[0].message
        thinking = message.model_extra["reasoning_content"]
        assert free.startswith(thinking) and len(thinking) < len(free) and message.content
        assert budgeted[0].usage.completion_tokens == 24
        anthropic_client = anthropic.Anthropic(base_url=f"http://localhost:{port}", api_key="x", max_retries=0)
        reply = anthropic_client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=24,
                                                 thinking={"type": "enabled", "budget_tokens": 5}, extra_body=GREEDY)
        assert [block.type for block in reply.content] == ["thinking", "text"]
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        api.chat.completions.create(**args, extra_body={"thinking_token_budget": 5})


def test_structured_output_follows_the_schema(api, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    out = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    choice = api.completions.create(model=model, prompt="Yes or no?", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    # vLLM's completions take response_format too (a completions client of vLLM's sends it so)
    completion = api.completions.create(model=model, prompt="A person as JSON:", max_tokens=60, temperature=0,
                                        extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                            "name": "person", "schema": schema}}})
    value = json.loads(completion.choices[0].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_structural_tags_hold_each_tagged_segment_to_its_schema(api, model):
    """vLLM's and SGLang's response_format structural_tag (their structures, and xgrammar's format tree): free
    text in which a trigger opens a tagged segment.
    The tiny model is pushed to write the trigger (a logit bias on its one token, "Call", 12800 in SmolLM2's
    vocabulary): each "Call" opens "Call(", JSON following the schema, ")"; speculation writes what target-only
    does, and a refused structure is named."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    fmt = {"type": "structural_tag", "structures": [{"begin": "Call(", "schema": schema, "end": ")"}],
           "triggers": ["Call"]}
    args = dict(model=model, messages=CHAT, max_tokens=40, temperature=0, logit_bias={"12800": 30})
    tagged = {k: api.chat.completions.create(**args, response_format=fmt, extra_body={"num_draft_tokens": k})
              .choices[0].message.content for k in (0, 4)}
    assert tagged[0] == tagged[4]
    segments = tagged[0].split("Call")
    assert len(segments) >= 4, tagged[0]
    for segment in segments[1:-1]:  # (the last may be cut by max_tokens)
        assert re.match(r'\(\{"n":[0-9]\}\)', segment), tagged[0]
    plain = api.chat.completions.create(**args).choices[0].message.content
    assert "Call" in plain and not re.search(r'Call\(\{"n":[0-9]\}\)', plain)  # the guide wrote those
    with pytest.raises(openai.BadRequestError, match=r"structures\[0\]: 'begin' 'Call\(' starts with none of"):
        api.chat.completions.create(**args, response_format={**fmt, "triggers": ["Tool"]})
    # xgrammar's format form of the same tags: the same text, speculated or not
    tree = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["Call"], "tags": [
        {"type": "tag", "begin": "Call(", "content": {"type": "json_schema", "json_schema": schema}, "end": ")"}]}}
    for k in (0, 4):
        assert api.chat.completions.create(**args, response_format=tree, extra_body={"num_draft_tokens": k}
                                           ).choices[0].message.content == tagged[0]
    with pytest.raises(openai.BadRequestError, match=r"format.tags\[0\].content.style must be one of"):
        api.chat.completions.create(**args, response_format={"type": "structural_tag", "format": {
            **tree["format"], "tags": [{**tree["format"]["tags"][0], "content": {
                "type": "json_schema", "json_schema": schema, "style": "yaml"}}]}})


def test_log_probs_match_the_ensemble(server, api, model):
    direct = grpc_stream(server.grpc_url, None, messages=json.dumps(CHAT), max_tokens=10, temperature=0.0,
                         return_log_probs=True)
    client = grpc_log_probs(server, CHAT)
    out = api.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True)
    entries = out.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == out.choices[0].message.content == direct[tn.TEXT_OUTPUT]
    assert np.allclose([e.logprob for e in entries], client, atol=1e-5)
    assert all(e.top_logprobs == [] for e in entries)
    # each token's bytes, those it stands for: joined, the answer (a character split over tokens too)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == out.choices[0].message.content
    streamed = api.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                           stream=True)
    values = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert np.allclose(values, client, atol=1e-5)
    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.token_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]

    # top_logprobs: each position's most likely tokens, the chosen (greedy) one first, as the ensemble sends them
    top = api.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                      top_logprobs=3)
    entries = top.choices[0].logprobs.content
    assert top.choices[0].message.content == direct[tn.TEXT_OUTPUT] and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob for e in entries)
    assert all(a.logprob >= b.logprob for e in entries for a, b in zip(e.top_logprobs, e.top_logprobs[1:]))
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for e in entries for t in e.top_logprobs)
    legacy = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    assert [max(row, key=row.get) for row in legacy.choices[0].logprobs.top_logprobs] == legacy.choices[0].logprobs.tokens


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(server, api, model):
    """lm-eval's loglikelihood request (a prompt of token ids, echo, logprobs 1, max_tokens 1, temperature 0):
    the prompt's tokens come first with their log-probabilities (None for the first, as OpenAI gives it) and
    each position's most likely token, as the ensemble scores them (checked against transformers in
    test_generation_api), then the generated one; max_tokens 0 scores only; a text prompt is echoed as sent,
    whole or streamed."""
    from transformers import AutoTokenizer

    from client import Client, GenerationParams
    from specdec.serving.pairs import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    ids = tokenizer(PROMPT).input_ids
    reference = Client(server.grpc_url).generate(PROMPT, GenerationParams(
        max_tokens=1, temperature=0.0, return_prompt_log_probs=True, return_log_probs=True, num_top_log_probs=1))
    assert reference.prompt_ids == ids
    out = api.completions.create(model=model, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True,
                                 seed=1234)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:len(ids)], reference.prompt_log_probs, atol=1e-6)
    assert np.allclose(lp.token_logprobs[-1], reference.log_probs[0], atol=1e-6)
    assert all(len(row) == 1 for row in lp.top_logprobs[1:])
    assert out.choices[0].text == PROMPT + reference.text and "".join(lp.tokens) == out.choices[0].text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1
    # lm-eval's reading: the continuation's log-likelihood, and whether greedy decoding would produce it
    ctxlen = 4
    continuation = lp.token_logprobs[ctxlen:-1]
    assert sum(continuation) == pytest.approx(sum(reference.prompt_log_probs[ctxlen - 1:]), abs=1e-4)
    greedy = all(value == max(top.values()) for value, top in zip(continuation, lp.top_logprobs[ctxlen:-1]))
    assert greedy == all(row[0] == token for row, token in zip(reference.prompt_top_ids[ctxlen - 1:], ids[ctxlen:]))

    only = api.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=0, temperature=0, logprobs=0,
                                  echo=True)
    assert [c.text for c in only.choices] == [PROMPT, "".join(only.choices[1].logprobs.tokens)]
    assert only.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:len(ids)]
    assert only.choices[0].logprobs.top_logprobs is None
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids) + 3
    # vLLM's prompt_logprobs k: per prompt token after the first its log-probability and rank and the k most
    # likely there ({id: {logprob, rank, decoded_token}}); a completion's per choice, a chat's once
    ranked = Client(server.grpc_url).generate(PROMPT, GenerationParams(
        max_tokens=1, temperature=0.0, return_prompt_log_probs=True, return_log_probs=True, num_top_log_probs=3,
        apply_chat_template=False))
    assert ranked.prompt_ids == ids and len(ranked.prompt_ranks) == len(ids) - 1
    listed = api.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                    extra_body={"prompt_logprobs": 3}).choices[0]
    assert listed.prompt_logprobs[0] is None and len(listed.prompt_logprobs) == len(ids)
    assert all(len(row) == 1 for row in listed.logprobs.top_logprobs)  # logprobs' own count, not 3
    for i, entry in enumerate(listed.prompt_logprobs[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(ranked.prompt_log_probs[i], abs=1e-6)
        assert own["rank"] == ranked.prompt_ranks[i] and own["decoded_token"] == tokenizer.decode([ids[i + 1]])
        assert [int(t) for t in entry][1:] == [t for t in ranked.prompt_top_ids[i] if t != ids[i + 1]]
        assert len(entry) == 3 + (ids[i + 1] not in ranked.prompt_top_ids[i])
        assert [entry[str(t)]["rank"] for t in ranked.prompt_top_ids[i] if t != ids[i + 1]] == [
            j + 1 for j, t in enumerate(ranked.prompt_top_ids[i]) if t != ids[i + 1]]
    assert any(row["rank"] > 3 for entry in listed.prompt_logprobs[1:] for row in entry.values())
    echoed_too = api.completions.create(model=model, prompt=[ids], max_tokens=0, temperature=0, logprobs=0, echo=True)
    assert [list(e) for e in echoed_too.choices[0].prompt_logprobs[1:]] == [[str(t)] for t in ids[1:]]
    chat = api.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0, n=2,
                                       extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    templated = chat.prompt_token_ids  # the chat template's tokens
    assert len(chat.prompt_logprobs) == len(templated) > len(ids) and chat.prompt_logprobs[0] is None
    for entry, token in zip(chat.prompt_logprobs[1:], templated[1:]):
        own = entry[str(token)]
        assert list(entry)[0] == str(token) and (own["rank"] == 1) == (len(entry) == 1)  # the most likely: alone
        assert all(row["logprob"] > own["logprob"] and row["rank"] == 1 for row in list(entry.values())[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        api.chat.completions.create(model=model, messages=CHAT, stream=True, extra_body={"prompt_logprobs": 1})

    plain = api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    echoed = api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain and echoed.choices[0].logprobs is None
    chunks = [c for c in api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                                logprobs=0, stream=True) if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT) and "".join(c.choices[0].text for c in chunks) == PROMPT + plain
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and np.allclose(streamed[1:len(ids)], reference.prompt_log_probs, atol=1e-6)
    assert len(streamed) == len(ids) + 8


def test_the_responses_api_answers_as_the_chat_does(server, api, model):
    """POST /v1/responses through the SDK's `responses.create`: the chat's answer for the same conversation,
    whole and streamed (its events in order, the deltas joining to the text), usage and status; a named
    function tool called, a JSON schema followed; a response not stored asked for is refused naming the field."""
    chat = api.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    whole = api.responses.create(model=model, instructions=CHAT[0]["content"], input=CHAT[1]["content"],
                                 max_output_tokens=16, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 16)
    events = list(api.responses.create(model=model, input=CHAT, max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == chat.choices[0].message.content == events[-1].response.output_text
    # include: the output text's log-probabilities, the chat's for the same tokens, whole and streamed
    scored = api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=2).choices[0].logprobs.content
    asked = {"model": model, "input": CHAT, "max_output_tokens": 8, "temperature": 0, "top_logprobs": 2,
             "include": ["message.output_text.logprobs"]}
    got = api.responses.create(**asked).output[0].content[0].logprobs
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in got] == [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in scored] and len(got) == 8
    events = list(api.responses.create(**asked, stream=True))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in got]
    assert not api.responses.create(model=model, input=CHAT, max_output_tokens=2).output[0].content[0].logprobs
    tool = {"type": "function", "name": "book_table", "description": "Book a table.",
            "parameters": {"type": "object", "properties": {"guests": {"type": "integer", "maximum": 20},
                                                            "day": {"enum": ["Friday", "Saturday"]}},
                           "required": ["guests", "day"], "additionalProperties": False}}
    for stream in (False, True):
        out = api.responses.create(model=model, input="Book a table for 2 on Friday.", tools=[tool],
                                   tool_choice={"type": "function", "name": "book_table"}, max_output_tokens=40,
                                   temperature=0, stream=stream)
        final = [e for e in out][-1].response if stream else out
        (call,) = [item for item in final.output if item.type == "function_call"]
        assert call.name == "book_table" and set(json.loads(call.arguments)) == {"guests", "day"}
        assert final.status == "completed"
    # The SDK's stream helper, which checks each item's identity from added to done and builds the answer
    with api.responses.stream(model=model, input="Book a table for 2 on Friday.", tools=[tool], temperature=0,
                              tool_choice={"type": "function", "name": "book_table"}, max_output_tokens=40) as stream:
        events = list(stream)
        built = stream.get_final_response()
    assert [item.type for item in built.output] == ["function_call"] and built.output[0].arguments == call.arguments
    # a named function's arguments stream as they are generated, not at the end
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(arguments) > 1 and "".join(arguments) == call.arguments
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    shaped = api.responses.create(model=model, input="A colour, as JSON.", max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(shaped.output_text)) == {"colour"}
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model=model, input="x", previous_response_id="resp_1")
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as caught:  # the server's refusals, named as this API names them
        api.responses.create(model=model, input="x", max_output_tokens=10**7)
    assert caught.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model=model, input="word " * 1100, max_output_tokens=4, truncation="auto")
    assert caught.value.body["param"] == "input" and "context" in caught.value.body["message"]


def test_a_stored_response_is_continued_read_and_deleted(server, api, model):
    """`store` (the default) keeps a response: `previous_response_id` continues its conversation (the chat's
    answer for the whole conversation, whole and streamed, a tool call's result sent back included; its
    instructions not carried over), `responses.retrieve` reads it, `responses.delete` forgets it; a response
    not stored, deleted, or with an earlier one of its conversation deleted cannot be continued."""
    def chat(messages: list[dict], **settings) -> str:
        return api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                           **settings).choices[0].message.content

    first = api.responses.create(model=model, instructions="You are terse.", input="My name is Ada.",
                                 max_output_tokens=12, temperature=0)
    assert first.store and first.previous_response_id is None
    conversation = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text}]
    second = api.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                  max_output_tokens=12, temperature=0)
    conversation.append({"role": "user", "content": "What is my name?"})
    assert second.previous_response_id == first.id
    assert second.output_text == chat(conversation)  # the first's instructions are not carried over
    conversation.append({"role": "assistant", "content": second.output_text})
    events = list(api.responses.create(model=model, previous_response_id=second.id, input="Spell it.",
                                       instructions="Be brief.", max_output_tokens=12, temperature=0, stream=True))
    third = events[-1].response
    expected = chat([{"role": "system", "content": "Be brief."}, *conversation, {"role": "user", "content": "Spell it."}])
    assert third.output_text == expected and third.previous_response_id == second.id and third.store
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    assert api.responses.retrieve(third.id).output_text == third.output_text  # stored before it was answered done
    assert api.responses.retrieve(first.id).model_dump() == first.model_dump()
    # its request's input items, paged as the SDK pages them (newest first by default)
    sent = [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "input_text", "text": "Bye"}]}]
    listed = api.responses.create(model=model, input=sent, max_output_tokens=2)
    pages = list(api.responses.input_items.list(listed.id, limit=3))  # two pages
    assert [(item.role, item.content[0].text) for item in pages] == [
        (message["role"], message["content"] if isinstance(message["content"], str) else "Bye") for message in sent[::-1]]
    assert [item.content[0].type for item in pages] == ["input_text", "output_text", "input_text", "input_text"]
    assert [item.id for item in api.responses.input_items.list(listed.id, order="asc")] == [item.id for item in pages[::-1]]
    (asked,) = api.responses.input_items.list(second.id).data
    assert (asked.type, asked.role, asked.content[0].text) == ("message", "user", "What is my name?")
    # an agent's turn: the model calls a function, its result is sent back as the next input
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"], "additionalProperties": False}}
    called = api.responses.create(model=model, input="Weather in Oslo?", tools=[tool], max_output_tokens=30,
                                  tool_choice={"type": "function", "name": "weather"}, temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    answered = api.responses.create(model=model, previous_response_id=called.id, tools=[tool], max_output_tokens=12,
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
                                    tool_choice="none", temperature=0)
    calls = [{"id": call.call_id, "type": "function", "function": {"name": "weather", "arguments": call.arguments}}]
    (result,) = api.responses.input_items.list(answered.id).data
    assert (result.type, result.call_id, result.output) == ("function_call_output", call.call_id, "rain")
    assert answered.output_text == chat(
        [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": calls},
         {"role": "tool", "tool_call_id": call.call_id, "content": "rain"}],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": tool["parameters"]}}],
        tool_choice="none")
    # not stored, deleted, or an earlier response of the conversation deleted: refused by name, and 404 to read
    unkept = api.responses.create(model=model, input="x", max_output_tokens=2, store=False)
    assert not unkept.store
    api.responses.delete(first.id)
    for gone in (unkept.id, first.id):
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(gone)
    for gone, named in ((unkept.id, unkept.id), (first.id, first.id), (third.id, first.id)):
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model=model, previous_response_id=gone, input="x", max_output_tokens=2)
        assert caught.value.body["param"] == "previous_response_id" and named in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.input_items.list(listed.id, limit=101)
    assert caught.value.body["param"] == "limit"


def test_a_conversation_is_continued_by_responses_and_edited_as_openais_are(server, api, model):
    """The Conversations API through the SDK: a conversation created with items and metadata, continued by
    responses naming it (each the chat's greedy answer for the whole conversation, whole, streamed and in the
    background), which add their input and output; items added, read, deleted and listed; metadata updated;
    the conversation deleted; refusals naming the field."""
    def chat(messages):
        return api.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           temperature=0).choices[0].message.content

    conversation = api.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                            metadata={"topic": "names"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}
    first = api.responses.create(model=model, conversation=conversation.id, input="What is my name?",
                                 max_output_tokens=8, temperature=0)
    said = [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "What is my name?"}]
    assert first.output_text == chat(said) and first.conversation.id == conversation.id
    items = list(api.conversations.items.list(conversation.id, order="asc"))
    assert [(item.type, item.role) for item in items] == [("message", "user")] * 2 + [("message", "assistant")]
    assert items[-1].content[0].text == first.output_text
    events = list(api.responses.create(model=model, conversation={"id": conversation.id}, input="Again?",
                                       max_output_tokens=8, temperature=0, stream=True))
    said += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Again?"}]
    second = events[-1].response
    assert second.output_text == chat(said)
    background = _until_done(api, api.responses.create(model=model, conversation=conversation.id, input="Once more.",
                                                       max_output_tokens=8, temperature=0, background=True).id)
    said += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more."}]
    assert background.output_text == chat(said)
    assert len(list(api.conversations.items.list(conversation.id))) == 7
    added = api.conversations.items.create(conversation.id, items=[{"type": "message", "role": "user",
                                                                    "content": "A note."}])
    (note,) = added.data
    assert api.conversations.items.retrieve(note.id, conversation_id=conversation.id).content[0].text == "A note."
    newest = api.conversations.items.list(conversation.id, limit=2)  # newest first, as OpenAI lists them
    assert [item.id for item in newest.data][0] == note.id and newest.has_more
    api.conversations.items.delete(note.id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        api.conversations.items.retrieve(note.id, conversation_id=conversation.id)
    assert api.conversations.update(conversation.id, metadata={"topic": "ada"}).metadata == {"topic": "ada"}
    assert api.conversations.retrieve(conversation.id).metadata == {"topic": "ada"}
    assert api.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.conversations.retrieve(conversation.id)
    for bad, param in (({"conversation": conversation.id}, "conversation"),
                       ({"conversation": "conv_x", "previous_response_id": first.id}, "conversation")):
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model=model, input="x", max_output_tokens=2, **bad)
        assert caught.value.body["param"] == param
    for items, param in (([{"type": "message", "role": "user", "content": "x"}] * 21, "items"),
                         ([{"type": "web_search_call"}], "items[0].type")):
        with pytest.raises(openai.BadRequestError) as caught:
            api.conversations.create(items=items)
        assert caught.value.body["param"] == param


def test_truncation_auto_drops_a_conversations_oldest_turns_to_fit_the_context(server, api, model):
    """A stored conversation grown past the context (1024 tokens here; each turn about 370): with
    `truncation: auto` its oldest turn is dropped and the answer is the chat's over the rest (whole and
    streamed, the usage counting what was kept); with `disabled`, the default, it is refused naming input."""
    filler = "The quick brown fox jumps over the lazy dog. " * 35
    first = api.responses.create(model=model, input="A: " + filler, max_output_tokens=4, temperature=0)
    second = api.responses.create(model=model, previous_response_id=first.id, input="B: " + filler,
                                  max_output_tokens=4, temperature=0)
    for truncation in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model=model, previous_response_id=second.id, input="C: " + filler,
                                 max_output_tokens=8, **truncation)
        assert caught.value.body["param"] == "input" and "context" in caught.value.body["message"]
    kept = [{"role": "user", "content": "B: " + filler}, {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "C: " + filler}]
    chat = api.chat.completions.create(model=model, messages=kept, max_tokens=8, temperature=0)
    whole = api.responses.create(model=model, previous_response_id=second.id, input="C: " + filler,
                                 max_output_tokens=8, temperature=0, truncation="auto")
    streamed = list(api.responses.create(model=model, previous_response_id=second.id, input="C: " + filler,
                                         max_output_tokens=8, temperature=0, truncation="auto", stream=True))[-1].response
    for answer in (whole, streamed):
        assert answer.truncation == "auto" and answer.output_text == chat.choices[0].message.content
        assert answer.usage.input_tokens == chat.usage.prompt_tokens < second.usage.input_tokens + 400
    # continuing the truncated answer: the store keeps the whole conversation, cut again as it needs
    after = api.responses.create(model=model, previous_response_id=whole.id, input="D?", max_output_tokens=8,
                                 temperature=0, truncation="auto")
    assert after.usage.input_tokens < chat.usage.prompt_tokens + 40


def _until_done(client, response_id: str):
    """A background response polled as clients poll it, until it has ended."""
    deadline = time.monotonic() + 120
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.1)
    return response


def _long_background(server, client, model):
    """A background response that runs for seconds (900 tokens), once the server is generating it."""
    started = client.responses.create(model=model, input=PROMPT, max_output_tokens=900, temperature=0,
                                      background=True, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 30
    while not server.metric("specdec_live_sequences") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.responses.retrieve(started.id).status == "in_progress"
    return started


def test_a_background_response_is_polled_cancelled_or_failed(server, api, model):
    """`background: true`: answered at once (in_progress), generated by the API, polled with GET until done (the
    foreground's answer), continued once done; cancelled while it generates (the server's sequence cancelled
    and freed, the status stays cancelled), an ended one's cancel answers it as it is; the server's refusal
    is a failed response naming why; refusals: with store false, a cancel of a foreground response."""
    foreground = api.responses.create(model=model, input="Name a colour.", max_output_tokens=12, temperature=0)
    started = api.responses.create(model=model, input="Name a colour.", max_output_tokens=12, temperature=0,
                                   background=True)
    assert started.background and started.status == "in_progress" and started.output == [] and started.store
    done = _until_done(api, started.id)
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text) and done.background
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert api.responses.cancel(done.id).status == done.status  # ended: answered as it is
    follow = api.responses.create(model=model, previous_response_id=done.id, input="Another.", max_output_tokens=4,
                                  temperature=0)
    assert follow.usage.input_tokens > done.usage.input_tokens
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    long = _long_background(server, api, model)
    with pytest.raises(openai.BadRequestError) as caught:  # not done: no answer to continue from
        api.responses.create(model=model, previous_response_id=long.id, input="x", max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id" and "in_progress" in caught.value.body["message"]
    assert api.responses.cancel(long.id).status == "cancelled"
    _settled_cancelled(server, before, 1)
    assert api.responses.retrieve(long.id).status == "cancelled"
    refused = _until_done(api, api.responses.create(model=model, input="x", max_output_tokens=10**7,
                                                    background=True).id)
    assert refused.status == "failed" and refused.error.code and "max_output_tokens" in refused.error.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.cancel(foreground.id)
    assert "background" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model=model, input="x", background=True, store=False)
    assert caught.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        api.responses.cancel("resp_unknown")


def test_a_background_response_streams_and_a_client_that_left_resumes_where_it_was(server, api, model):
    """`background` with `stream`: the request's own stream (events numbered from 0, the foreground's text,
    ended by its end's event), streamed again with GET ?stream=true from any event (raw, and through the
    SDK's stream helper); a client that leaves mid-stream stops nothing and resumes after the last event it
    saw; a cancel ends the resumed stream; refusals: a foreground response's stream, a bad starting_after."""
    foreground = api.responses.create(model=model, input="Name a colour.", max_output_tokens=12, temperature=0)
    events = list(api.responses.create(model=model, input="Name a colour.", max_output_tokens=12, temperature=0,
                                       background=True, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert (events[0].type, events[-1].type) == ("response.created", "response." + foreground.status)
    done = events[-1].response
    assert done.background and done.output_text == foreground.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == foreground.output_text
    again = list(api.responses.retrieve(done.id, stream=True, starting_after=2))
    assert [(e.sequence_number, e.type) for e in again] == [(e.sequence_number, e.type) for e in events[3:]]
    with api.responses.stream(response_id=done.id) as helper:
        assert "".join(e.delta for e in helper if e.type == "response.output_text.delta") == foreground.output_text
    # a client that leaves after five events: the response goes on, and the client comes back for the rest
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    stream = api.responses.create(model=model, input=PROMPT, max_output_tokens=900, temperature=0, background=True,
                                  stream=True, extra_body={"ignore_eos": True})
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 5:
            break
    stream.close()
    response_id = seen[0].response.id
    time.sleep(0.5)
    assert api.responses.retrieve(response_id).status == "in_progress"
    assert server.metric("specdec_requests_total", finish_reason="cancelled") == before
    resumed = api.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number)
    events = iter(resumed)
    more = [next(events) for _ in range(3)]
    assert [event.sequence_number for event in more] == [5, 6, 7]
    assert api.responses.cancel(response_id).status == "cancelled"
    assert all(event.type == "response.output_text.delta" for event in events)  # it ends, with no end event
    _settled_cancelled(server, before, 1)
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.retrieve(foreground.id, stream=True)
    assert caught.value.body["param"] == "stream"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{server.openai_url}/responses/{done.id}?stream=true&starting_after=x", timeout=10)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["param"] == "starting_after"


def test_replicas_sharing_a_store_directory_continue_each_others_conversations(server, api, model, tmp_path):
    """Two gateways with one --responses-store-dir (two replicas on one volume): a conversation begun on one
    is continued on the other (the chat's answer for the whole of it), read and deleted there, a conversation
    too, and a background response one generates is streamed and cancelled from the other; a gateway started later over the directory (a
    restart) still has it all, and one that stops while generating in the background leaves it failed."""
    store = ["--responses-store-dir", str(tmp_path / "responses")]
    with own_gateway(server, model, *store) as port_a, own_gateway(server, model, *store) as port_b:
        a = openai.OpenAI(base_url=f"http://127.0.0.1:{port_a}/v1", api_key="unused", max_retries=0)
        b = openai.OpenAI(base_url=f"http://127.0.0.1:{port_b}/v1", api_key="unused", max_retries=0)
        first = a.responses.create(model=model, input="My name is Ada.", max_output_tokens=8, temperature=0)
        second = b.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                    max_output_tokens=8, temperature=0)
        expected = api.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]).choices[0].message.content
        assert second.output_text == expected and b.responses.retrieve(first.id).output_text == first.output_text
        third = list(a.responses.create(model=model, previous_response_id=second.id, input="Again?", stream=True,
                                        max_output_tokens=8, temperature=0))[-1].response
        assert b.responses.retrieve(third.id).output_text == third.output_text
        b.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(third.id)
        # a conversation begun on one replica is continued on the other, which adds to it
        conversation = a.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi, I am Ada."}])
        b.responses.create(model=model, conversation=conversation.id, input="Who am I?", max_output_tokens=4)
        assert len(list(a.conversations.items.list(conversation.id))) == 3
        # a background response generated by one replica, polled and cancelled on the other: it stops there
        before = server.metric("specdec_requests_total", finish_reason="cancelled")
        long = _long_background(server, a, model)
        assert b.responses.retrieve(long.id).status == "in_progress"
        followed = iter(b.responses.retrieve(long.id, stream=True, starting_after=0))  # its stream, from b
        assert [next(followed).sequence_number for _ in range(3)] == [1, 2, 3]
        assert b.responses.cancel(long.id).status == "cancelled"
        assert all(event.type != "response.completed" for event in followed)  # it ends
        _settled_cancelled(server, before, 1)
        assert a.responses.retrieve(long.id).status == "cancelled"
    with own_gateway(server, model, *store, "--drain-timeout", "0.5") as port:
        later = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert later.responses.retrieve(second.id).output_text == second.output_text
        assert [item.content[0].text for item in later.responses.input_items.list(second.id)] == ["What is my name?"]
        unfinished = _long_background(server, later, model)  # still generating when this replica stops
    with own_gateway(server, model, *store) as port:
        last = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stopped = last.responses.retrieve(unfinished.id)
        assert stopped.status == "failed" and stopped.error.code == "server_shutdown"
    _settled_cancelled(server, before, 2)


# ---- Anthropic's Messages API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(server):
    """Anthropic's SDK against the same API (its base URL is the server's root: it adds /v1/messages)."""
    client = anthropic.Anthropic(base_url=server.openai_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                 timeout=120)
    yield client
    client.close()


SYSTEM, ASK = CHAT[0]["content"], [CHAT[1]]
GREEDY = {"temperature": 0}  # the SDK no longer types the sampling settings; the API takes them as older clients send them
CLAUDE_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                  "input_schema": WEATHER["function"]["parameters"]}


def test_anthropic_messages_answer_as_the_chat_does_whole_streamed_and_counted(api, claude, model):
    """/v1/messages through the `anthropic` SDK: the chat's greedy answer for the same conversation (system
    apart), its usage and stop reason; streamed as Anthropic's events (the SDK's text stream and final message
    the same); count_tokens the prompt's tokens; the model list as Anthropic's SDK reads it."""
    chat = api.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    message = claude.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    # the prompt's tokens: those the prefix cache held (the chat just computed them) apart, as Anthropic counts
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with claude.messages.stream(model=model, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)
    events = [event.type for event in claude.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=12,
                                                             extra_body=GREEDY, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens
    card, *adapters = claude.models.list().data  # Anthropic's model list, from the same endpoint (then the adapters)
    assert [adapter.id for adapter in adapters] == [TINY_LORA, *TINY_LORA_LIBRARY]
    assert (card.id, card.type, card.display_name) == (model, "model", model) and card.created_at.year >= 2026
    assert claude.models.retrieve(model).id == model


def _batch_file(api, lines: list[dict]) -> str:
    return api.files.create(file=("requests.jsonl", "\n".join(json.dumps(line) for line in lines).encode()),
                            purpose="batch").id


def _batch_ended(api, batch_id: str):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def test_a_batch_of_requests_is_answered_as_each_request_would_be(server, api, model):
    """OpenAI's Batch API through the SDK: a JSON-lines file uploaded, a batch of its chat requests answered by
    the server, each line's answer the chat's own (greedy), a request the server refuses in the error file
    naming its field; counts and usage; the files listed, read and deleted; a batch cancelled while it runs
    stops, its requests in flight cancelled on the server."""
    questions = ["Name a colour.", "Name a fruit.", "Name a city."]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0}}
             for i, q in enumerate(questions)]
    lines.insert(1, {**lines[0], "custom_id": "too-long", "body": {**lines[0]["body"], "max_tokens": 10**6}})
    upload = _batch_file(api, lines)
    batch = api.batches.create(input_file_id=upload, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "test"}, output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert batch.status == "in_progress" and batch.request_counts.total == 4 and batch.metadata == {"run": "test"}
    batch = _batch_ended(api, batch.id)
    output = api.files.retrieve(batch.output_file_id)  # its output file expires as asked (the SDK's form of the object)
    assert output.expires_at - output.created_at == 7200 and api.files.retrieve(upload).expires_at is None
    expiring = api.files.create(file=("x.jsonl", b"{}"), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    assert expiring.expires_at - expiring.created_at == 3600 and api.files.delete(expiring.id).deleted
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        api.files.create(file=("x.jsonl", b"{}"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 5})
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    out = [json.loads(text) for text in api.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["q0", "q1", "q2"]
    for answer, question in zip(out, questions):
        direct = api.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                             max_tokens=8, temperature=0)
        assert answer["response"]["status_code"] == 200
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    (refused,) = [json.loads(text) for text in api.files.content(batch.error_file_id).text.splitlines()]
    assert refused["custom_id"] == "too-long" and refused["response"]["status_code"] == 400
    assert "max_tokens" in refused["response"]["body"]["error"]["message"]
    assert batch.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    assert upload in [f.id for f in api.files.list(purpose="batch").data]
    assert batch.id in [b.id for b in api.batches.list().data]
    assert api.files.delete(upload).deleted and upload not in [f.id for f in api.files.list().data]
    # the Responses API's requests too
    ask = {"model": model, "input": questions[0], "max_output_tokens": 16, "temperature": 0, "store": False}
    answered = _batch_ended(api, api.batches.create(
        input_file_id=_batch_file(api, [{"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": ask}]),
        endpoint="/v1/responses", completion_window="24h").id)
    (line,) = [json.loads(text) for text in api.files.content(answered.output_file_id).text.splitlines()]
    direct = api.responses.create(**ask)
    assert "".join(part["text"] for item in line["response"]["body"]["output"] if item["type"] == "message"
                   for part in item["content"]) == direct.output_text
    assert answered.usage.output_tokens == direct.usage.output_tokens
    # cancelled while it runs: 40 long answers, 32 at a time
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    long = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"Story {i}:", "max_tokens": 600, "ignore_eos": True}} for i in range(40)]
    running = api.batches.create(input_file_id=_batch_file(api, long), endpoint="/v1/completions",
                                 completion_window="24h")
    time.sleep(0.5)
    assert api.batches.cancel(running.id).status in ("cancelling", "cancelled")
    stopped = _batch_ended(api, running.id)
    assert stopped.status == "cancelled" and stopped.request_counts.completed < 40
    in_flight = 40 - stopped.request_counts.completed - stopped.request_counts.failed
    assert in_flight > 0
    _settled_cancelled(server, before, min(in_flight, 32))


# ~120 tokens of the tiny pair's tokenizer; its first words are no other test's, so its first request computes them
CACHED_SYSTEM = ("Cache-usage test. You answer visitors' questions about a lighthouse museum on a rocky northern "
                 "coast. The museum opens at ten and closes at five from April to October, and only on weekends in "
                 "winter. The tower's one hundred and twelve steps are climbed with a guide every hour on the hour; "
                 "children under eight climb with an adult. The shop sells maps, postcards and knitted hats.")


# ~100 tokens no other test sends
SALTED_SYSTEM = ("Cache-salt test. You help visitors of a botanical garden on a southern island find the glasshouses: "
                 "the orchid house is by the north gate, the cactus house beyond the lily pond, the fern gully down "
                 "the stone steps, and the tea room at the top of the hill, open from nine until four.")


def _draft_prefix_hits(server) -> float:
    """The draft model's prefix-cache hits once its sequences are released (when it counts them)."""
    deadline = time.monotonic() + 10
    while server.metric("specdec_model_live_sequences", model="draft_model") and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.metric("specdec_model_prefix_cache_hits_total", model="draft_model")


def test_a_cache_salt_shares_cached_prompts_only_among_its_own_requests(server, api, model):
    """vLLM's cache_salt: a prompt finds in the prefix caches (the target's, reported as cached_tokens, and
    the draft model's) only what requests of the same salt computed, never another salt's or the shared
    cache's; the answers are the same."""
    chat = [{"role": "system", "content": SALTED_SYSTEM}, {"role": "user", "content": "Where are the ferns?"}]

    def ask(salt: str | None) -> tuple[int, str, float]:
        nonlocal prompt_tokens
        before = _draft_prefix_hits(server)
        answer = api.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=0, extra_body={
            "draft_model": "draft_model", "num_draft_tokens": 3, "adaptive_draft": False,
            **({"cache_salt": salt} if salt else {})})
        found = _draft_prefix_hits(server) - before
        prompt_tokens = answer.usage.prompt_tokens
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].message.content, found

    prompt_tokens = 0
    first, text, _ = ask("tenant-a")
    again, again_text, draft_found = ask("tenant-a")
    assert prompt_tokens > 64 and (first, again) == (0, (prompt_tokens - 1) // 32 * 32)  # its whole blocks of 32
    assert again_text == text and draft_found > 0
    for other in ("tenant-b", None):  # another salt, and the shared cache, find none of tenant-a's blocks
        cached, other_text, draft_found = ask(other)
        assert (cached, draft_found, other_text) == (0, 0, text), other


RESET_SYSTEM = ("You answer questions about the harbour. The ferry leaves from pier two at every full hour, the "
                "fish market opens at five and closes at noon, the lighthouse may be climbed on Sundays, the harbour "
                "master's office is the red house by the crane, and the sailing school rents boats from May on.")


def test_a_cache_reset_empties_the_target_and_draft_prefix_caches(server, api, model):
    """vLLM's POST /reset_prefix_cache and SGLang's /flush_cache (POST or GET): a prompt the target's prefix
    cache (cached_tokens) and the draft model's (its hits) held is found in neither after a reset, with the
    same answer, and both fill again; a flag that is no boolean is refused, naming it."""
    chat = [{"role": "system", "content": RESET_SYSTEM}, {"role": "user", "content": "When does the ferry leave?"}]

    def ask() -> tuple[int, str, float]:
        before = _draft_prefix_hits(server)
        answer = api.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=0, extra_body={
            "draft_model": "draft_model", "num_draft_tokens": 3, "adaptive_draft": False})
        found = _draft_prefix_hits(server) - before
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].message.content, found

    root = server.openai_url.removesuffix("/v1")

    def reset(path: str, method: str = "POST") -> tuple[int, str]:
        request = urllib.request.Request(root + path, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode()

    ask()
    cached, text, draft_found = ask()
    assert cached >= 64 and draft_found > 0  # held by both
    flushed, both_flags = "Cache flushed.\n", "?reset_running_requests=true&reset_external=false"
    for path, method, expected in (("/reset_prefix_cache", "POST", ""), ("/flush_cache", "POST", flushed),
                                   ("/flush_cache", "GET", flushed), ("/reset_prefix_cache" + both_flags, "POST", "")):
        assert reset(path, method) == (200, expected), path
        assert ask() == (0, text, 0), path  # found in neither cache, the same answer
        assert ask() == (cached, text, draft_found), path  # and cached again by that request
    status, body = reset("/reset_prefix_cache?reset_external=maybe")
    assert status == 400 and json.loads(body)["error"]["param"] == "reset_external"
    assert ask()[0] == cached  # a refused reset resets nothing


def test_a_clients_profile_traces_the_models_executions(server, api, model):
    """vLLM's and SGLang's POST /start_profile and /stop_profile (the session's server has --torch-profiler-dir):
    the stop answers once target_model's and draft_model's traces are written, naming them; each holds that
    model's profiled executions (their labels, torch's operators), and the answer is what it is unprofiled.
    A bad setting is refused naming it; a stop with no profile running is refused; SGLang's GET works too."""
    root = server.openai_url.removesuffix("/v1")

    def call(path: str, body: dict | None = None, method: str = "POST") -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(root + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode()

    def ask() -> str:
        answer = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three rivers."}],
                                             max_tokens=8, temperature=0,
                                             # K fixed: the adaptive policy may draft nothing, and then
                                             # draft_model has no execution to trace (seen once in CI)
                                             extra_body={"draft_model": "draft_model", "num_draft_tokens": 3,
                                                         "adaptive_draft": False})
        return answer.choices[0].message.content

    unprofiled = ask()
    assert call("/start_profile", {"activities": ["CPU"], "record_shapes": True}) == (200, "Start profiling.\n")
    assert ask() == unprofiled
    status, text = call("/stop_profile")
    assert status == 200 and text.startswith("Stop profiling.\n"), text
    traces = text.splitlines()[1:]
    assert sorted(re.sub(r"^.*-(\w+_model)-\d+\.trace\.json\.gz$", r"\1", path) for path in traces) == [
        "draft_model", "target_model"], text
    for path in traces:
        with gzip.open(path, "rt") as trace:
            found = json.load(trace)["traceEvents"]
        name = "target_model" if "-target_model-" in path else "draft_model"
        executes = {e["name"] for e in found if e.get("cat") == "user_annotation" and e["name"].startswith(name)}
        assert f"{name} execute 0" in executes and any(e.get("cat") == "cpu_op" for e in found), path
        assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tracing")]
    assert call("/stop_profile")[0] == 400  # none running now
    status, text = call("/start_profile", {"num_steps": 0})
    assert status == 400 and json.loads(text)["error"]["param"] == "num_steps"
    status, text = call("/start_profile", {"activities": ["RPD"]})
    assert status == 400 and json.loads(text)["error"]["param"] == "activities"
    assert call("/start_profile", method="GET") == (200, "Start profiling.\n")
    status, text = call("/stop_profile", method="GET")  # nothing executed meanwhile: no trace, and no wait
    assert (status, text) == (200, "Stop profiling.\n")
    assert ask() == unprofiled


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(api, claude, model):
    """The prompt's tokens the server's prefix cache held (its whole blocks of 32 but the last token's: that
    one's logits are needed), as each API reports them: the chat's and completions' prompt_tokens_details
    (streamed with the usage too), the Responses API's input_tokens_details, Anthropic's cache_read_input_tokens
    beside the input tokens it did compute; none on a prompt's first run."""
    chat = [{"role": "system", "content": CACHED_SYSTEM}, {"role": "user", "content": "Can my dog come in?"}]
    cold = api.chat.completions.create(model=model, messages=chat, max_tokens=4, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.usage.prompt_tokens > 96
    reusable = (cold.usage.prompt_tokens - 1) // 32 * 32
    warm = api.chat.completions.create(model=model, messages=chat, max_tokens=4, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens == reusable
    assert warm.choices[0].message.content == cold.choices[0].message.content
    streamed = list(api.chat.completions.create(model=model, messages=chat, max_tokens=4, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == reusable
    text = api.completions.create(model=model, prompt=CACHED_SYSTEM + " Question: is there a cafe?", max_tokens=4,
                                  temperature=0)
    assert text.usage.prompt_tokens_details.cached_tokens == 0  # no chat template: other tokens from the first
    response = api.responses.create(model=model, input=chat, max_output_tokens=16, temperature=0)
    assert response.usage.input_tokens_details.cached_tokens == reusable == (response.usage.input_tokens - 1) // 32 * 32
    message = claude.messages.create(model=model, system=CACHED_SYSTEM, messages=chat[1:], max_tokens=4,
                                     extra_body=GREEDY)
    usage = message.usage
    assert (usage.cache_read_input_tokens, usage.input_tokens, usage.cache_creation_input_tokens) == (
        reusable, cold.usage.prompt_tokens - reusable, 0)
    with claude.messages.stream(model=model, system=CACHED_SYSTEM, messages=chat[1:], max_tokens=4,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.usage.cache_read_input_tokens, final.usage.input_tokens) == (reusable, usage.input_tokens)


def test_a_stream_silent_past_the_keepalive_gets_comment_lines_the_sdks_skip(server, api, claude, model):
    """A gateway whose keepalive (--stream-keepalive) is shorter than the server takes to its first token
    sends the stream's headers and comment lines while it waits; the SDKs read the same answers."""
    expected = api.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    with own_gateway(server, model, "--stream-keepalive", "0.001") as port:
        body = {"model": model, "messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True}
        request = urllib.request.Request(f"http://localhost:{port}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            data = answer.read()
        assert data.startswith(b": keepalive\n\n") and data.endswith(b"data: [DONE]\n\n")
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        streamed = client.chat.completions.create(**{k: v for k, v in body.items()})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            expected.choices[0].message.content
        messages = anthropic.Anthropic(base_url=f"http://localhost:{port}", api_key="x", max_retries=0)
        with messages.messages.stream(model=model, system=SYSTEM, messages=ASK, max_tokens=12,
                                      extra_body=GREEDY) as stream:
            assert stream.get_final_message().content[0].text == expected.choices[0].message.content


def test_a_prefilled_answer_is_continued_over_triton_the_chat_api_and_anthropics(server, api, claude, model):
    """An answer's beginning sent as the last message (vLLM's continue_final_message; Anthropic's prefill) is
    continued: the prompt is the chat template's with that message left open, and the greedy continuation is
    what the model writes after those tokens given as they are (a completion of the rendered prompt's ids);
    vLLM's chat `echo` puts the message before it."""
    from specdec.decoding.text import chat_ids, load_tokenizer
    from specdec.serving.pairs import smollm2_tokenizer_dir

    prefilled = [*CHAT, {"role": "assistant", "content": "Red, green"}]
    ids = chat_ids(load_tokenizer(str(smollm2_tokenizer_dir())), prefilled, None, "messages", continue_final=True)
    reference = api.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    params = dict(max_tokens=8, temperature=0.0, num_draft_tokens=2, ignore_eos=True)
    served = grpc_stream(server.grpc_url, None, messages=json.dumps(prefilled),
                         continue_final_message=np.array([[True]], dtype=np.bool_), **params)
    assert (served[tn.NUM_INPUT_TOKENS], served[tn.TEXT_OUTPUT]) == (len(ids), reference.choices[0].text)
    answer = api.chat.completions.create(model=model, messages=prefilled, max_tokens=8, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    assert (answer.usage.prompt_tokens, answer.choices[0].message.content) == (len(ids), reference.choices[0].text)
    # vLLM's chat echo: the assistant's last message leads the content, whole and streamed (a chunk of its own)
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True, "echo": True}
    echoed = api.chat.completions.create(model=model, messages=prefilled, max_tokens=8, temperature=0, extra_body=extra)
    assert echoed.choices[0].message.content == "Red, green" + reference.choices[0].text
    chunks = [chunk.choices[0].delta.content for chunk in api.chat.completions.create(
        model=model, messages=prefilled, max_tokens=8, temperature=0, extra_body=extra, stream=True) if chunk.choices]
    assert chunks[1] == "Red, green" and "".join(c or "" for c in chunks) == echoed.choices[0].message.content
    message = claude.messages.create(model=model, max_tokens=8, system=CHAT[0]["content"], messages=[
        {"role": "user", "content": CHAT[1]["content"]}, {"role": "assistant", "content": "Red, green"}],
        extra_body={**GREEDY, "ignore_eos": True})
    assert message.content[0].text == reference.choices[0].text and message.usage.output_tokens == 8
    with pytest.raises(GenerationError, match="continue_final_message"):  # a chat to continue, not a prompt
        grpc_stream(server.grpc_url, "Hello", continue_final_message=np.array([[True]], dtype=np.bool_), **params)


def test_anthropic_stop_sequences_tools_and_tool_results(api, claude, model):
    """stop_sequences end the answer before the sequence (stop_reason stop_sequence, naming it); a tool chosen
    by name answers a tool_use block whose input follows its schema (streamed as input_json_delta, the same
    input), and the next turn carries it and its tool_result."""
    words = claude.messages.create(model=model, messages=ASK, max_tokens=40,
                                   extra_body={"temperature": 0, "ignore_eos": True}).content[0].text
    cut = max(range(4, len(words) - 3), key=lambda i: words[i:i + 3].isalpha() and words[:i + 3].isascii())
    sequence = words[cut:cut + 3]
    assert sequence.isalpha(), words
    stopped = claude.messages.create(model=model, messages=ASK, max_tokens=40, stop_sequences=["\u00a7never", sequence],
                                     extra_body={"temperature": 0, "ignore_eos": True})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    assert stopped.content[0].text == words[:words.index(sequence)]

    named = {"tools": [CLAUDE_WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    called = claude.messages.create(model=model, messages=ASK, max_tokens=48, extra_body=GREEDY, **named)
    (use,) = called.content
    assert (use.type, use.name, called.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert use.id.startswith("toolu_")
    assert set(use.input) == {"city"} and isinstance(use.input["city"], str)
    with claude.messages.stream(model=model, messages=ASK, max_tokens=48, extra_body=GREEDY, **named) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].input == use.input and final.stop_reason == "tool_use" and "input_json" in kinds
    assert final.content[0].id.startswith("toolu_")
    answer = claude.messages.create(model=model, max_tokens=8, extra_body=GREEDY, tools=[CLAUDE_WEATHER], messages=[
        *ASK, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20 C and sunny"}]}],
        tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("request_args, named", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"stop_sequences": "x"}, "stop_sequences"), ({"temperature": -1}, "temperature"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"mcp_servers": []}, "mcp_servers")])
def test_anthropic_refusals_are_its_errors_naming_the_field(claude, model, request_args, named):
    body = {"model": model, "messages": ASK, "max_tokens": 4, **request_args}
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(anthropic.BadRequestError) as caught:  # sent as it is: the SDK would refuse some itself
        claude.post("/v1/messages", body=body, cast_to=object)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert named in caught.value.body["error"]["message"]


def test_anthropic_unknown_model_and_a_client_that_leaves(server, claude, model):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-unknown", messages=ASK, max_tokens=4)
    assert caught.value.body["error"]["type"] == "not_found_error"
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    with claude.messages.stream(model=model, messages=ASK, max_tokens=900,
                                extra_body={"temperature": 0, "ignore_eos": True}) as stream:
        for i, _ in enumerate(stream.text_stream):
            if i == 2:
                break
    _settled_cancelled(server, before, 1)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _native(server, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, object]:
    """SGLang's native API on the API's port, as its docs' clients call it (`requests.post(url + "/generate",
    json=...)`): (status, the JSON answer)."""
    root = server.openai_url.removesuffix("/v1")
    request = urllib.request.Request(root + path, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text.lstrip()[:1] in "[{" else text
    except urllib.error.HTTPError as refused:
        text = refused.read().decode(errors="replace")
        return refused.code, json.loads(text) if text.startswith("{") else {"error": {"message": text}}


def _bench_serving_stream(server, body: dict) -> tuple[list[dict], list[str]]:
    """A streamed /generate read line by line as SGLang's bench_serving reads it (aiohttp, each line stripped,
    `data: ` removed, [DONE] skipped, the text so far in each event): (the events, every line's payload)."""
    import aiohttp

    async def read():
        events, lines = [], []
        url = server.openai_url.removesuffix("/v1") + "/generate"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            async for raw in response.content:
                line = raw.strip()
                if line:
                    lines.append(line.decode().removeprefix("data: "))
                    if lines[-1] != "[DONE]":
                        events.append(json.loads(lines[-1]))
        return events, lines
    return asyncio.run(read())


def test_sglangs_generate_answers_as_completions_do_whole_streamed_and_batched(server, api, model):
    """SGLang's native /generate (what `sglang.bench_serving --backend sglang` and RL rollout workers send):
    the greedy completion's text and tokens, SGLang's meta_info with the speculative figures, streamed with the
    output so far in each event; batches of texts or token ids, one sampling_params or one per prompt, n
    choices; log-probabilities as the completions path's; a stop string named in finish_reason."""
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True, "return_token_ids": True}).model_dump()
    expected, ids = whole["choices"][0]["text"], whole["choices"][0]["token_ids"]
    status, out = _native(server, "/generate", {"text": PROMPT, "rid": "mine", "sampling_params": greedy})
    assert status == 200 and out["text"] == expected and out["output_ids"] == ids
    meta = out["meta_info"]
    assert meta["id"] == "mine" and meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (whole["usage"]["prompt_tokens"], 12)
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] == 12 / meta["spec_verify_ct"]
    assert meta["e2e_latency"] > 0

    events, lines = _bench_serving_stream(server, {"text": PROMPT, "sampling_params": greedy, "stream": True})
    assert lines[-1] == "[DONE]" and events[-1]["text"] == expected and events[-1]["output_ids"] == ids
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == 12  # each event adds tokens (bench_serving's ITL)
    assert all(later["text"].startswith(e["text"]) for e, later in zip(events, events[1:]))
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"

    # a batch: texts and token ids alike, each output its prompt's completion; log-probabilities as completions'
    prompt_ids = whole["choices"][0]["prompt_token_ids"]
    status, batch = _native(server, "/generate", {"input_ids": [prompt_ids, prompt_ids[:3]], "rid": ["a", "b"],
                                                  "sampling_params": greedy, "return_logprob": True,
                                                  "top_logprobs_num": 2, "return_text_in_logprobs": True})
    assert status == 200 and [o["meta_info"]["id"] for o in batch] == ["a", "b"] and batch[0]["text"] == expected
    short = api.completions.create(model=model, prompt=prompt_ids[:3], max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert batch[1]["text"] == short.choices[0].text
    logprobs = batch[0]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == ids and "".join(text for _, _, text in logprobs) == expected
    assert np.allclose([v for v, _, _ in logprobs], whole["choices"][0]["logprobs"]["token_logprobs"], atol=1e-5)
    tops = batch[0]["meta_info"]["output_top_logprobs"]
    assert all(len(row) == 2 and row[0][1] == t for row, t in zip(tops, ids))
    status, split = _native(server, "/generate", {"text": [PROMPT, PROMPT], "sampling_params": [
        {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}, greedy]})
    assert status == 200 and [o["text"] for o in split] == [split[0]["text"], expected]
    assert [o["meta_info"]["completion_tokens"] for o in split] == [3, 12] and expected.startswith(split[0]["text"])
    status, sampled = _native(server, "/generate", {"text": PROMPT, "rid": "s", "sampling_params": {
        "n": 2, "temperature": 1.0, "sampling_seed": 5, "max_new_tokens": 8}})
    assert status == 200 and [o["meta_info"]["id"] for o in sampled] == ["s-0", "s-1"]
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]  # each choice its own seed (seed + j)

    word = expected.split()[2]
    status, stopped = _native(server, "/generate", {"text": PROMPT, "sampling_params": {**greedy, "stop": [word]}})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert stopped["text"] == expected[:expected.index(word)]
    status, kept = _native(server, "/generate", {"text": PROMPT, "sampling_params": {
        **greedy, "stop": [word], "no_stop_trim": True}})
    assert kept["text"] == expected[:expected.index(word) + len(word)]

    # max_new_tokens 0 (RL trainers' and SGLang's `select`): the prompt's log-probabilities alone, as echo scores it
    status, scored = _native(server, "/generate", {"input_ids": prompt_ids, "return_logprob": True,
                                                   "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    echoed = api.completions.create(model=model, prompt=prompt_ids, echo=True, logprobs=1, max_tokens=0,
                                    temperature=0).choices[0].logprobs
    meta = scored["meta_info"]
    assert status == 200 and (scored["text"], scored["output_ids"], meta["completion_tokens"]) == ("", [], 0)
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt_ids
    assert meta["input_token_logprobs"][0][0] is None and echoed.token_logprobs[0] is None
    assert np.allclose([v for v, _, _ in meta["input_token_logprobs"][1:]], echoed.token_logprobs[1:], atol=1e-5)


def test_sglangs_incremental_streaming_output_sends_what_each_event_adds(server, model):
    """An API started with SGLang's --incremental-streaming-output (the launcher sets it for the flag): a streamed
    /generate of two prompts with log-probabilities, read as bench_serving reads it, concatenates per index to
    the text, tokens and log-probabilities of the same request answered whole, in several events."""
    body = {"text": [PROMPT, "The colour of the sky is"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    status, whole = _native(server, "/generate", body)
    assert status == 200 and len(whole) == 2
    with own_gateway(server, model, "--incremental-streaming-output") as port:
        events, _ = _bench_serving_stream(type("Local", (), {"openai_url": f"http://localhost:{port}/v1"}),
                                          {**body, "stream": True})
    for index, output in enumerate(whole):
        mine = [event for event in events if event["index"] == index]
        assert len(mine) > 1 and "".join(event["text"] for event in mine) == output["text"]
        assert sum((event["output_ids"] for event in mine), []) == output["output_ids"]
        logprobs = sum((event["meta_info"]["output_token_logprobs"] for event in mine), [])
        expected = output["meta_info"]["output_token_logprobs"]
        assert [entry[1] for entry in logprobs] == [entry[1] for entry in expected]
        assert np.allclose([entry[0] for entry in logprobs], [entry[0] for entry in expected], atol=1e-5)
        counts = [event["meta_info"]["completion_tokens"] for event in mine]
        assert counts == sorted(counts) and counts[-1] == 12 and mine[-1]["meta_info"]["finish_reason"]["type"] == \
            "length"


def test_sglangs_server_info_model_info_health_generate_and_refusals(server, model):
    """/get_server_info's avg_spec_accept_length (what bench_serving prints as "Accept length") is the
    server's tokens per drafting round, from its metrics; /get_model_info; /health_generate generates; bad
    requests get 400 naming SGLang's field and the server serves on."""
    _native(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    own = metrics_text.scrape(server.metrics_url)
    rounds = metrics_text.sum_samples(own, "specdec_accepted_length_count")
    accepted = metrics_text.sum_samples(own, "specdec_accepted_draft_tokens_total")
    for path in ("/get_server_info", "/server_info"):
        status, info = _native(server, path)
        assert status == 200 and info["served_model_name"] == model
        assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(1 + accepted / rounds)
    _native(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    assert _native(server, "/get_server_info")[1]["internal_states"][0]["last_gen_throughput"] > 0
    status, info = _native(server, "/get_model_info")
    assert status == 200 and info["model_path"] == model and info["is_generation"] is True
    assert _native(server, "/health_generate") == (200, "ok\n")
    for body, param in [({"text": PROMPT, "image_data": "cat.png"}, "image_data"),
                        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 10**6}},
                         "sampling_params.max_new_tokens"),
                        ({"text": PROMPT, "sampling_params": {"top_k": "x"}}, "sampling_params.top_k"),
                        ({"text": PROMPT, "lora_path": "no-such-adapter"}, "lora_path"),
                        ({"input_ids": [10**8]}, "text")]:
        status, refused = _native(server, "/generate", body)
        assert status in (400, 404) and refused["error"]["param"] == param, refused
    assert _native(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})[0] == 200

    # every field and sampling_params key with values of the wrong type or past any range: a 4xx naming it
    from specdec.gateway import sglang_native

    bad = [-1, "x", [1, "a"], {"a": 1}, 1e308]
    unanswered = []
    cases = [(name, None) for name in sglang_native.FIELDS if name not in ("text", "input_ids")] + \
        [(None, key) for key in (*sglang_native.SAMPLING, *sglang_native.CONSTRAINTS)]
    for name, key in cases:
        for value in bad:
            params = {"max_new_tokens": 2, "temperature": 0, **({key: value} if key else {})}
            body = {"text": PROMPT, "sampling_params": params, **({name: value} if name else {})}
            if name == "sampling_params":
                body[name] = value
            try:
                status, answer = _native(server, "/generate", body)
            except OSError as error:  # never answered
                unanswered.append((name or key, value, repr(error)))
                continue
            if status >= 500 or (status >= 400 and not answer["error"].get("param")):
                unanswered.append((name or key, value, status, answer))
    assert not unanswered, unanswered
    assert _native(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_the_tokenizer_endpoints_tokenize_as_the_server_does(server, api, model):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (what lm-eval's remote tokenizer uses): a chat's count is
    the chat endpoint's prompt_tokens, a prompt's tokens are the completions endpoint's, the model card and
    /tokenize give the server's context; a bad request names its field."""
    root = server.openai_url.removesuffix("/v1")
    chat = _post(f"{root}/tokenize", {"model": model, "messages": CHAT})
    assert chat["count"] == api.chat.completions.create(model=model, messages=CHAT, max_tokens=1).usage.prompt_tokens
    plain = _post(f"{root}/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert plain["count"] == api.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert len(plain["token_strs"]) == plain["count"] and plain["max_model_len"] > plain["count"]
    assert _post(f"{root}/detokenize", {"tokens": plain["tokens"]}) == {"prompt": PROMPT}
    with urllib.request.urlopen(f"{root}/tokenizer_info", timeout=30) as response:
        info = json.loads(response.read())
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == plain["max_model_len"]
    assert api.models.retrieve(model).model_extra["max_model_len"] == plain["max_model_len"]
    with pytest.raises(urllib.error.HTTPError) as caught:
        _post(f"{root}/detokenize", {"tokens": [-4]})
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["param"] == "tokens"


def grpc_log_probs(server, messages) -> list[float]:
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    out: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: out.put((result, error)))
    client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(None, messages=json.dumps(messages), max_tokens=10,
                                                           temperature=0.0, return_log_probs=True, stream=True),
                              enable_empty_final_response=True)
    values = []
    while True:
        result, error = out.get(timeout=60)
        assert error is None, error
        if result.get_response().outputs and result.as_numpy(tn.OUTPUT_LOG_PROBS) is not None:
            values += result.as_numpy(tn.OUTPUT_LOG_PROBS).reshape(-1).tolist()
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return values


@pytest.mark.parametrize("request_args, param", [
    ({"n": 0}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 5.0}, "presence_penalty"),  # refused by the server, named as the request's field
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"extra_body": {"num_draft_tokens": 999}}, "num_draft_tokens"),
    ({"extra_body": {"draft_model": "nope"}}, "draft_model"),
    ({"extra_body": {"priority": 2**31}}, "priority"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "word " * 1100}]}, "messages"),  # over the context, by the server
])
def test_refusals_are_openai_errors_naming_the_field(api, model, request_args, param):
    args = {"model": model, "messages": CHAT, "max_tokens": 4, **request_args}
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(**args)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param, caught.value.body
    assert api.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].finish_reason  # serving on


def test_a_chat_the_server_refuses_names_messages(server):
    with pytest.raises(GenerationError, match="messages"):
        grpc_stream(server.grpc_url, None, messages=json.dumps([{"role": "king", "content": "hi"}]), max_tokens=2)
    with pytest.raises(GenerationError, match="exclude each other"):
        grpc_stream(server.grpc_url, "hi", messages=json.dumps(CHAT), max_tokens=2)
    with pytest.raises(GenerationError, match="'tools' needs 'messages'"):
        grpc_stream(server.grpc_url, "hi", tools=json.dumps([WEATHER]), max_tokens=2)
    with pytest.raises(GenerationError, match=r"'tools'\[0\]"):
        grpc_stream(server.grpc_url, None, messages=json.dumps(CHAT), tools='[{"type": "function"}]', max_tokens=2)
    with pytest.raises(GenerationError, match="input 'messages' is not JSON"):  # nested past the decoder's depth
        grpc_stream(server.grpc_url, None, messages="[" * 5000, max_tokens=2)


@pytest.mark.parametrize("body", [b"{not json", b"[]", b'{"a":' * 5000])
def test_a_body_that_is_no_json_object_is_refused(server, body):
    """400 in OpenAI's error form, whatever the body: a JSON nested past the decoder's depth was a 500."""
    request = urllib.request.Request(f"{server.openai_url}/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"


def test_an_api_key_is_required_when_set(server, model):
    """A gateway of its own with a key, in front of the same server."""
    with own_gateway(server, model, env={"SPECDEC_API_KEY": "s3cret"}) as port:
        url = f"http://localhost:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
        assert answers(gateway_url(port), 2)  # the health check needs no key (probes have none)
        with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10) as page:  # nor do scrapers
            assert b"specdec_openai_requests_total" in page.read()
        # Anthropic's clients send it as x-api-key
        root = f"http://localhost:{port}"
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0).messages.create(
                model=model, messages=ASK, max_tokens=2)
        assert refused.value.body["error"]["type"] == "authentication_error"
        assert anthropic.Anthropic(base_url=root, api_key="s3cret", max_retries=0).messages.create(
            model=model, messages=ASK, max_tokens=2).usage.output_tokens == 2
        request = urllib.request.Request(f"http://localhost:{port}/tokenize", data=b'{"prompt": "a"}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:  # the tokenizer endpoints need it too
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 401
        # SGLang's native API: /generate and the info pages behind the key, /health_generate not (a probe's)
        native = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        local = type("Local", (), {"openai_url": url})
        assert _native(local, "/generate", native)[0] == _native(local, "/get_server_info")[0] == 401
        assert _native(local, "/generate", native, {"Authorization": "Bearer s3cret"})[0] == 200
        assert _native(local, "/health_generate")[0] == 200
        # resetting the caches too; this gateway was started without the launcher's marker: it cannot
        # nor profile the models (no --torch-profiler-dir)
        for path, names in (("/flush_cache", "SPECDEC_CACHE_RESET_FILE"), ("/reset_prefix_cache", "SPECDEC_CACHE"),
                            ("/start_profile", "--torch-profiler-dir"), ("/stop_profile", "--torch-profiler-dir")):
            request = urllib.request.Request(root + path, data=b"", method="POST")
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=10)
            assert caught.value.code == 401, path
            request.add_header("Authorization", "Bearer s3cret")
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=10)
            assert caught.value.code == 501 and names in caught.value.read().decode(), path


def _outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), None where it has only the loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_host_binds_the_api_to_one_address(server, model):
    """OPENAI_HOST (vLLM's and SGLang's --host, which the launcher sets it from): the API answers at that address
    and at no other of this machine's."""
    with own_gateway(server, model, env={"OPENAI_HOST": "127.0.0.1"}) as port:
        assert answers(gateway_url(port, "127.0.0.1"), 5)
        outward = _outward_address()
        if outward is not None:  # (a machine with only the loopback has no other address to try)
            with pytest.raises(OSError):
                socket.create_connection((outward, port), timeout=5).close()
    with own_gateway(server, model) as port:  # unset: every interface
        assert answers(gateway_url(port, "127.0.0.1"), 5)
        if outward is not None:
            socket.create_connection((outward, port), timeout=5).close()


def _leave_a_stream(api, model, chunks: int, n: int = 1) -> None:
    """A long streamed completion of n choices, closed by the SDK after `chunks` chunks."""
    stream = api.completions.create(model=model, prompt=PROMPT, n=n, max_tokens=900, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == chunks:
            break
    stream.close()


def _settled_cancelled(server, before: float, expected: int) -> None:
    """Every cancelled request counted, nothing live, no round running on."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = [server.metric("specdec_live_sequences"),
                server.metric("specdec_model_live_sequences", model="target_model")]
        cancelled = server.metric("specdec_requests_total", finish_reason="cancelled") - before
        if live == [0, 0] and cancelled == expected:
            break
        time.sleep(0.3)
    assert live == [0, 0] and cancelled == expected, (live, cancelled)
    rounds = server.metric("specdec_rounds_total")
    time.sleep(1.0)
    assert server.metric("specdec_rounds_total") == rounds


def test_a_client_that_goes_away_cancels_its_generation(server, api, model):
    """Mid-stream (the SDK's stream closed after two chunks), without reading a byte (the connection closed
    once the generation runs), and waiting for an answer asked whole (the client's timeout): the server
    cancels the sequence and frees it."""
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    _leave_a_stream(api, model, chunks=2)
    _settled_cancelled(server, before, 1)
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.openai_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30  # closed, without reading a byte, once the generation runs
        while not server.metric("specdec_live_sequences") and time.monotonic() < deadline:
            time.sleep(0.02)
    _settled_cancelled(server, before, 2)
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    # an answer asked whole whose client gives up waiting (its timeout): the server's generation stops too
    impatient = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=1.0)
    for ask in (lambda: impatient.completions.create(model=model, prompt=PROMPT, max_tokens=900, temperature=0,
                                                      extra_body={"ignore_eos": True}),
                lambda: impatient.chat.completions.create(model=model, messages=CHAT, max_tokens=900, temperature=0,
                                                          extra_body={"ignore_eos": True})):
        with pytest.raises(openai.APITimeoutError):
            ask()
    _settled_cancelled(server, before, 4)
    impatient.close()


def test_sagemakers_ping_and_invocations_and_the_version(api, model, server):
    """SageMaker's container contract as vLLM serves it: GET /ping answers while ready, POST /invocations answers
    a chat body as the chat endpoint does and a completion body as completions does; GET /version."""
    root = server.openai_url.removesuffix("/v1")

    def call(path: str, body: dict | None = None) -> tuple[int, dict | str]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(root + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                text = response.read().decode()
                return response.status, json.loads(text) if text.startswith("{") else text
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    assert call("/ping") == (200, "ok\n")
    chat = {"model": model, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    status, answer = call("/invocations", chat)
    expected = api.chat.completions.create(**chat).choices[0].message.content
    assert status == 200 and answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == expected
    status, answer = call("/invocations", {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert status == 200 and answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] == api.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                                                  temperature=0).choices[0].text
    status, error = call("/invocations", {"model": model})
    assert status == 400 and error["error"]["param"] == "messages"
    status, version = call("/version")
    assert status == 200 and version["version"] not in ("", "unknown")


def test_the_servers_figures_are_on_the_apis_metrics_under_vllms_names(server, api, model):
    """GET /metrics on the API's port also restates the server's metrics as vLLM names them (what dashboards,
    KEDA and the Gateway API Inference Extension read from vLLM): the same counts as the server's own port."""
    url = server.openai_url.removesuffix("/v1").removeprefix("http://")
    before = metrics_text.scrape(server.metrics_url)
    answer = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "num_draft_tokens": 3, "adaptive_draft": False})
    vllm, own = metrics_text.scrape(url), metrics_text.scrape(server.metrics_url)

    def grew(name: str) -> float:
        return metrics_text.sum_samples(own, name) - metrics_text.sum_samples(before, name)

    # The request's sizes and phases, in the server's histograms of them
    assert (grew("specdec_request_prompt_tokens_sum"), grew("specdec_request_output_tokens_sum"),
            grew("specdec_request_max_tokens_sum")) == (answer.usage.prompt_tokens, 12, 12)
    assert grew("specdec_request_prefill_seconds_count") == grew("specdec_request_decode_seconds_count") == 1
    assert grew("specdec_request_inference_seconds_sum") >= grew("specdec_request_decode_seconds_sum") > 0
    assert 1 <= grew("specdec_inter_token_latency_seconds_count") <= 11  # a round's tokens come together
    pairs = [("vllm:spec_decode_num_draft_tokens_total", "specdec_draft_tokens_total"),
             ("vllm:spec_decode_num_accepted_tokens_total", "specdec_accepted_draft_tokens_total"),
             ("vllm:generation_tokens_total", "specdec_output_tokens_total"),
             ("vllm:prompt_tokens_total", "specdec_prompt_tokens_total"),
             ("vllm:num_requests_running", "specdec_live_sequences"),
             ("vllm:time_to_first_token_seconds_count", "specdec_time_to_first_token_seconds_count"),
             ("vllm:request_time_per_output_token_seconds_sum", "specdec_time_per_output_token_seconds_sum"),
             ("vllm:request_prompt_tokens_sum", "specdec_request_prompt_tokens_sum"),
             ("vllm:request_params_max_tokens_count", "specdec_request_max_tokens_count"),
             ("vllm:request_inference_time_seconds_sum", "specdec_request_inference_seconds_sum"),
             ("vllm:inter_token_latency_seconds_count", "specdec_inter_token_latency_seconds_count")]
    for name, source in pairs:
        assert metrics_text.sum_samples(vllm, name, model_name=model) == metrics_text.sum_samples(own, source), name
    assert metrics_text.sum_samples(own, "specdec_draft_tokens_total") >= 3
    assert metrics_text.sum_samples(own, "specdec_prompt_tokens_total") > 0
    assert metrics_text.sum_samples(own, "specdec_time_per_output_token_seconds_count") > 0
    (usage,) = metrics_text.samples(vllm, "vllm:kv_cache_usage_perc")  # the tiny target's paged pool (static)
    assert usage[0] == {"model_name": model} and 0 <= usage[1] <= 1
    assert metrics_text.sum_samples(vllm, "vllm:request_success_total", finished_reason="length") == \
        metrics_text.sum_samples(own, "specdec_requests_total", finish_reason="length") > 0
    # vllm:lora_requests_info: the adapters running now (a streamed request of the session's adapter, under
    # way) and the target's adapter slots (the tiny pair's max_loras, 2)
    stream = api.completions.create(model=TINY_LORA, prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    ((labels, _),) = metrics_text.samples(metrics_text.scrape(url), "vllm:lora_requests_info")
    assert (labels["running_lora_adapters"], labels["max_lora"]) == (TINY_LORA, "2")
    stream.close()
    deadline = time.monotonic() + 30
    while metrics_text.samples(metrics_text.scrape(url), "vllm:lora_requests_info")[0][0]["running_lora_adapters"]:
        assert time.monotonic() < deadline  # (the stream closed: its generation cancelled, no adapter running)
        time.sleep(0.1)


def test_the_apis_own_metrics_count_requests_tokens_refusals_and_disconnects(server, api, model):
    """GET /metrics on the API's port: requests by route and status (200, the API's own refusals, a route that
    does not exist, a client gone mid-stream), usage's tokens, the time to the first token, stored responses."""
    url = server.openai_url.removesuffix("/v1")
    chat, completions = dict(method="POST", endpoint="/v1/chat/completions"), dict(method="POST",
                                                                                 endpoint="/v1/completions")

    def scrape():
        return metrics_text.scrape(url.removeprefix("http://"))

    def delta(name, **labels):
        return metrics_text.sum_samples(scrape(), name, **labels) - metrics_text.sum_samples(before, name, **labels)

    cancelled = server.metric("specdec_requests_total", finish_reason="cancelled")
    before = scrape()
    answer = api.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    streamed = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, messages=CHAT, max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        api.get("/no/such/route", cast_to=object)
    _leave_a_stream(api, model, chunks=2)
    _settled_cancelled(server, cancelled, 1)
    time.sleep(0.2)  # the gateway counts a disconnect once its handler is cancelled
    assert delta("specdec_openai_requests_total", **chat, code="200") == 1
    assert delta("specdec_openai_requests_total", **chat, code="400") == 1
    assert delta("specdec_openai_requests_total", method="GET", endpoint="unmatched", code="404") == 1
    assert delta("specdec_openai_requests_total", **completions, code="200") == 1
    assert delta("specdec_openai_requests_total", **completions, code="disconnected") == 1
    assert delta("specdec_openai_completion_tokens_total", **chat) == answer.usage.completion_tokens == 6
    assert delta("specdec_openai_prompt_tokens_total", **chat) == answer.usage.prompt_tokens
    # the same prompt twice: the one left mid-stream was read too (the server counts it with its first response)
    assert delta("specdec_openai_prompt_tokens_total", **completions) == 2 * streamed[-1].usage.prompt_tokens
    assert delta("specdec_openai_completion_tokens_total", **completions) >= 5 + 2  # the stream left after 2
    assert delta("specdec_openai_time_to_first_token_seconds_count", **chat) == 1  # the refused one had none
    assert delta("specdec_openai_time_to_first_token_seconds_count", **completions) == 2
    assert delta("specdec_openai_request_duration_seconds_count", **chat) == 2
    assert metrics_text.sum_samples(scrape(), "specdec_openai_requests_running", **completions) == 0
    # the Responses API's store: a stored response counted with its bytes, and gone when deleted
    stored = api.responses.create(model=model, input="Say hi.", max_output_tokens=3)
    assert delta("specdec_openai_stored_responses") == 1 and delta("specdec_openai_stored_response_bytes") > 0
    api.responses.delete(stored.id)
    assert delta("specdec_openai_stored_responses") == 0


def test_a_disconnect_stops_the_generation_within_a_round_or_so(server, model):
    """Target-only rounds (one token each) with vLLM's continuous usage: the client knows how many rounds it
    saw when it hangs up. The server runs at most the direct stream's bound more (a round on its way, the
    one in flight, one started before the flag: test_generation_api.py) plus one in the gateway's hands."""
    import requests

    cancelled = server.metric("specdec_requests_total", finish_reason="cancelled")
    _settled_cancelled(server, cancelled, 0)
    rounds_before = server.metric("specdec_rounds_total")
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0,
            "num_draft_tokens": 0, "stream": True, "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}}
    seen = 0
    with requests.post(f"{server.openai_url}/completions", json=body, stream=True, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert chunk["usage"]["completion_tokens"] >= seen  # continuous usage: on every chunk
                seen = chunk["usage"]["completion_tokens"]
                if seen >= 6:
                    break
    _settled_cancelled(server, cancelled, 1)
    ran = server.metric("specdec_rounds_total") - rounds_before
    print(f"the client saw {seen} rounds; the server ran {ran:.0f}")
    assert seen <= ran <= seen + 4


def test_a_gateway_that_dies_is_started_again_and_readiness_says_so(server, api, model):
    """SIGKILL the OpenAI API's process: the launcher's readiness answers 503 naming it until the launcher
    has started it again, then 200, and it serves."""
    def readiness() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(server.readiness_url, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    (pid,) = subprocess.run(["pgrep", "-f", f"specdec.gateway --port {server.openai_port} "], capture_output=True,
                            text=True).stdout.split()
    assert readiness() == (200, "ready\n")
    os.kill(int(pid), signal.SIGKILL)
    status, text = readiness()
    assert status == 503 and "OpenAI API" in text, (status, text)
    deadline = time.monotonic() + 60
    while readiness()[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert readiness() == (200, "ready\n")
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert "the OpenAI API exited" in server.log_tail(20000)


def test_every_field_of_every_endpoint_with_a_wrong_value_gets_a_4xx_and_the_server_serves_on(server, api, model):
    """Each field the API takes, set to values of the wrong type or beyond any range, on each endpoint: every
    answer is a 4xx naming the field (the server's own refusals included), none a 500 or a request that
    never ends. Such values found a 500 (a list for max_tokens) and a request never answered (a seed of
    1e308, which the server accepted and then failed to store)."""
    from specdec.gateway import protocol, responses

    bad = [-1, "x", [1, "a"], {"a": 1}, 1e308]  # a wrong sign, type, unhashable types, a number past any type
    # the fields the chat shares with the others are read by the same code: each endpoint's own here
    endpoints = {"chat/completions": ({"messages": CHAT}, protocol.CHAT_FIELDS),
                 "completions": ({"prompt": PROMPT}, set(protocol.COMPLETION_FIELDS) - set(protocol.CHAT_FIELDS)),
                 "responses": ({"input": PROMPT}, responses.OWN_FIELDS)}
    unanswered = []
    for endpoint, (base, fields) in endpoints.items():
        for field in sorted(set(fields) - {"model", "stream"}):
            for value in bad:
                body = {"model": model, "max_tokens" if endpoint != "responses" else "max_output_tokens": 2,
                        "temperature": 0, **base, field: value}
                request = urllib.request.Request(f"{server.openai_url}/{endpoint}", data=json.dumps(body).encode(),
                                                 method="POST", headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=30) as response:
                        response.read()  # accepted: a value the API takes (a bool for a flag, -1 for top_k)
                except urllib.error.HTTPError as error:
                    text = error.read().decode(errors="replace")
                    detail = json.loads(text)["error"] if text.startswith("{") else {"message": text}
                    if error.code >= 500 or not detail.get("param"):
                        unanswered.append((endpoint, field, value, error.code, detail["message"][:120]))
                except OSError as error:  # a timeout: the request was never answered
                    unanswered.append((endpoint, field, value, repr(error)))
    assert not unanswered, unanswered
    assert api.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].finish_reason


def _http(url: str, method: str, headers: dict, body: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method=method, headers={"Content-Type": "application/json", **headers},
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_a_browser_page_may_call_the_api_as_on_vllm_and_only_the_origins_allowed(server, model):
    """CORS (vLLM's --allowed-origins): a page's preflight is answered, and a streamed answer carries the header
    the browser needs to hand it to the page; with origins given, another's preflight is refused by name."""
    page = "https://chat.example.com"
    ask = {"Origin": page, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    chat = {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    status, headers, _ = _http(server.openai_url + "/chat/completions", "OPTIONS", ask)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    status, headers, body = _http(server.openai_url + "/chat/completions", "POST", {"Origin": page}, chat)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and body.rstrip().endswith(b"[DONE]")
    with own_gateway(server, model, "--allowed-origins", json.dumps([page]), "--api-key", "k") as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        status, _, body = _http(url, "OPTIONS", {**ask, "Origin": "https://elsewhere.example"})
        assert (status, body) == (400, b"Disallowed CORS origin")
        status, headers, _ = _http(url, "OPTIONS", ask)  # no key: a preflight never carries one
        assert status == 200 and headers["Access-Control-Allow-Origin"] == page and headers["Vary"] == "Origin"
        status, headers, body = _http(url, "POST", {"Origin": page, "Authorization": "Bearer k"}, chat)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == page and body.rstrip().endswith(b"[DONE]")


def test_a_request_without_max_tokens_runs_until_the_context_is_full_as_on_openai(server, api, model):
    """No max_tokens: what the context leaves (OpenAI's and vLLM's rule), not the Triton API's default_max_tokens
    (64), which would leave this prompt no room at all; one token more of prompt and nothing is left."""
    context = 1024  # the tiny pair's (pairs.tiny_pair)
    prompt = [7] * (context - 24)
    answer = api.completions.create(model=model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (24, "length")
    with pytest.raises(openai.BadRequestError, match="leaves none to generate"):
        api.completions.create(model=model, prompt=[7] * context, temperature=0)


def test_gpt_oss_harmony_channels_become_reasoning_content_and_tool_calls(server, model):
    """A gateway started as vLLM serves gpt-oss (--tool-call-parser openai, which implies --reasoning-parser
    openai_gptoss): the analysis channel comes as reasoning, the final channel (and commentary to the user) as
    content, a message to functions.NAME as a tool call, whole and streamed, over the chat and Responses APIs.
    The answers are forced into the format with guided_choice (the tiny pair is no gpt-oss)."""
    think = "<|channel|>analysis<|message|>Needs the weather tool.<|end|>"
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city":"Oslo"}')
    final = "<|start|>assistant<|channel|>final<|message|>Red, green, blue."
    from specdec.serving.pairs import smollm2_tokenizer_dir

    with own_gateway(server, model, "--tool-call-parser", "openai", "--enable-auto-tool-choice",
                     "--tokenizer", str(smollm2_tokenizer_dir())) as port:  # (the tokenizer counts thinking tokens)
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
        args = {"model": model, "messages": CHAT, "max_tokens": 128, "temperature": 0, "tools": [WEATHER]}
        whole = client.chat.completions.create(**args, extra_body={"guided_choice": [think + call]}).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert whole.message.model_extra["reasoning_content"] == "Needs the weather tool."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
            ("get_weather", {"city": "Oslo"})]
        chunks = [c.choices[0] for c in client.chat.completions.create(
            stream=True, **args, extra_body={"guided_choice": [think + call]}) if c.choices]
        assert "".join(c.delta.model_extra.get("reasoning_content") or "" for c in chunks) == "Needs the weather tool."
        assert not "".join(c.delta.content or "" for c in chunks)
        deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", {"city": "Oslo"})]
        answered = client.chat.completions.create(**args, extra_body={"guided_choice": [think + final]})
        thought = answered.usage.completion_tokens_details.reasoning_tokens  # the analysis message, markers too
        assert 5 < thought < answered.usage.completion_tokens - 5
        answer = answered.choices[0]
        assert (answer.message.content, answer.message.model_extra["reasoning_content"], answer.finish_reason) == \
            ("Red, green, blue.", "Needs the weather tool.", "stop")
        # the answer sent back as the SDK gave it (reasoning_content and all) continues the chat
        follow = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            *CHAT, answer.message, {"role": "user", "content": "And one more?"}])
        assert follow.choices[0].finish_reason in ("stop", "length")
        streamed = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            stream=True, **args, extra_body={"guided_choice": [think + final]}) if c.choices]
        assert "".join(streamed) == "Red, green, blue." and "<|" not in "".join(streamed)
        built = client.responses.create(model=model, input=CHAT, max_output_tokens=128, temperature=0,
                                        extra_body={"guided_choice": [think + final]})
        assert [item.type for item in built.output] == ["reasoning", "message"]
        assert built.output_text == "Red, green, blue."
        # Anthropic's SDK with thinking on (its budget unused: this vocabulary has no harmony markers to close on)
        claude = anthropic.Anthropic(base_url=f"http://localhost:{port}", api_key="x", max_retries=0)
        message = claude.messages.create(model=model, max_tokens=128, messages=[{"role": "user", "content": "Hi"}],
                                         thinking={"type": "enabled", "budget_tokens": 1024},
                                         extra_body={"guided_choice": [think + final]})
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[1].text == "Red, green, blue."


def test_a_predicted_output_is_drafted_from_and_changes_nothing_but_the_speed(api, model):
    """OpenAI's Predicted Outputs (`prediction`): a request that predicts its answer drafts it, greedy output
    unchanged; usage counts the prediction's tokens the target accepted and rejected, as OpenAI reports them."""
    args = {"model": model, "messages": CHAT, "max_tokens": 32, "temperature": 0,
            "extra_body": {"num_draft_tokens": 8, "adaptive_draft": False}}
    plain = api.chat.completions.create(**args).choices[0].message.content
    for prediction, accepted in ((plain, 20), ("Blue, and then " + plain, 0), ("Nothing like it at all.", 0)):
        answer = api.chat.completions.create(**args, prediction={"type": "content", "content": prediction})
        assert answer.choices[0].message.content == plain, prediction
        details = answer.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= accepted and details.rejected_prediction_tokens >= 0
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    streamed = api.chat.completions.create(**args, prediction={"type": "content", "content": plain}, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 20


def test_the_prediction_bench_runs_against_a_served_api(server):
    """`make bench-prediction`'s script, against the session's server (its table: every mode's answer equal)."""
    out = run_bench("prediction_bench", "--url", server.openai_url, "--repeats", "1", "--max-tokens", "12").stdout
    assert out.count("| yes |") == 9 and "| prediction |" in out
