"""Fuzz the server's HTTP front doors with malformed requests (`make fuzz`): every answer must be a refusal
that says what was wrong, or an answer; never a 500, a hang, a dropped connection or a server that stops.

Each request starts from a valid one of an endpoint (the OpenAI API's chat, completions, responses and
conversations, SageMaker's invocations, Anthropic's messages, SGLang's /generate, vLLM's tokenizer endpoints,
Triton's generate extension) with one to four of the endpoint's valid settings combined at random, and most take
one to three seeded mutations at random places in its JSON: a value of another type or out of range (huge and
negative numbers, NaN, lone surrogates, very long strings, deep nesting), a key removed or added, a list emptied
or grown; a few bodies are broken whole (not JSON, not an object, nested past any parser's depth), and each
endpoint first gets its request with a lone surrogate before every text. Triton's gRPC API gets the ensemble's
inputs as tensors (`tensor_request`: any of them, with values past their ranges, of another type or shape). An
answer is a finding when it is a 5xx other than 503 (overloaded), a 4xx whose body has no message, a gRPC error
that names no input, a stream that ends without its end, or no answer within the timeout; after every batch the
server must be ready again, and after the last every generation it started must be freed
(`specdec_live_sequences` and the models' live sequences back to what they were) and no request may have failed
with an error the orchestrators did not foresee (`specdec_requests_total{finish_reason="error"}` unchanged).

    python loadtest/fuzz.py --url localhost --requests 400 --seed 0      # a running server's ports
    python loadtest/fuzz.py --pair tiny --requests 400                  # a server of its own (`make fuzz`)

It prints a table per endpoint (answered, refused, Triton's own 500s apart, findings) and each finding's request
and answer, and exits 1 on any finding. Bodies are capped (max_tokens 16) so that a request that stays valid is
answered in moments; a mutation that asks for more tokens is a valid request and takes its time.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tabulate import tabulate

MAX_TOKENS = 16


@dataclass
class Endpoint:
    """A POST path on one of the server's ports ("openai" or "http") and the valid bodies mutations start from."""
    name: str
    port: str
    path: str
    seeds: list[dict]
    stream_end: str = "[DONE]"  # the last data line of a whole stream (OpenAI's); "" where streams are not fuzzed
    # Errors of the server's own frontend (not this project's code) that it answers with a 500: counted apart
    frontend_500: tuple[str, ...] = ()
    # Valid settings ("a.b": a key of the object at a) combined at random into the seeds (`combine`): the
    # features' interplay, where a request that is answered meets the most code
    features: dict[str, list] = field(default_factory=dict)


# Triton 24.10's HTTP frontend answers a generate body it cannot parse, or a value of the wrong JSON type for an
# input, with 500 and its parser's message, before any model sees the request (docs/api.md, Errors).
TRITON_PARSE_ERRORS = ("failed to parse the request JSON buffer", "Unable to parse JSON bytes array",
                       "Unable to parse 'data'", "attempt to access JSON non-", "attempt to get members for non-object")


def endpoints(model: str) -> list[Endpoint]:
    """The fuzzed endpoints, each with valid requests of its main features."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name"]}
    chat = [
        {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        {"model": model, "messages": messages, "max_completion_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.9,
         "top_k": 20, "seed": 3, "n": 2, "stop": ["\n\n", "end"], "presence_penalty": 0.5,
         "frequency_penalty": 0.2, "repetition_penalty": 1.1, "logit_bias": {"42": -100}, "logprobs": True,
         "top_logprobs": 2, "ignore_eos": True},
        {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
         "stream_options": {"include_usage": True}},
        {"model": model, "messages": messages + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
         "tools": [tool], "tool_choice": "required", "max_tokens": MAX_TOKENS},
        {"model": model, "messages": messages, "tools": [tool],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": MAX_TOKENS},
        {"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
         "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}},
        {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
         "max_tokens": MAX_TOKENS, "guided_regex": "[a-z]{1,8}", "stream": True},
    ]
    completions = [
        {"model": model, "prompt": "The sea is", "max_tokens": MAX_TOKENS, "temperature": 0},
        {"model": model, "prompt": [[464, 5521, 314], [504, 3575]], "max_tokens": MAX_TOKENS, "logprobs": 2,
         "echo": True, "seed": 1, "temperature": 1.0, "best_of": 1, "n": 1},
        {"model": model, "prompt": "Count:", "max_tokens": MAX_TOKENS, "stream": True, "stop": "5",
         "stream_options": {"include_usage": True}},
        {"model": model, "prompt": "Pick one:", "max_tokens": MAX_TOKENS, "guided_choice": ["yes", "no"],
         "prompt_logprobs": 1},
    ]
    responses = [
        {"model": model, "input": "Say hello.", "max_output_tokens": MAX_TOKENS, "instructions": "Be brief.",
         "store": False},
        {"model": model, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
         "max_output_tokens": MAX_TOKENS, "stream": True, "store": False, "temperature": 0},
        {"model": model, "input": "Describe a person.", "max_output_tokens": MAX_TOKENS, "store": False,
         "text": {"format": {"type": "json_schema", "name": "person", "schema": schema}}},
        {"model": model, "input": "Weather?", "max_output_tokens": MAX_TOKENS, "store": False,
         "tool_choice": "required",
         "tools": [{"type": "function", "name": "get_weather", "parameters": tool["function"]["parameters"]}]},
    ]
    anthropic_messages = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    anthropic = [
        {"model": model, "max_tokens": MAX_TOKENS, "messages": anthropic_messages, "system": "Be brief.",
         "stop_sequences": ["end"], "temperature": 0},
        {"model": model, "max_tokens": MAX_TOKENS, "messages": anthropic_messages, "stream": True,
         "tools": [{"name": "get_weather", "input_schema": tool["function"]["parameters"]}],
         "tool_choice": {"type": "tool", "name": "get_weather"}},
    ]
    sglang = [
        {"text": "The sea is", "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}},
        {"input_ids": [464, 5521, 314], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.7,
                                                             "top_k": 5, "stop": ["x"]},
         "return_logprob": True, "top_logprobs_num": 2, "stream": True},
    ]
    triton_features = {"temperature": [0.0, 0.7], "top_k": [1, 20], "top_p": [0.4], "seed": [5], "max_tokens": [1, 4],
                       "num_draft_tokens": [0, 2, 6], "min_length": [3], "ignore_eos": [True], "stream": [True],
                       "presence_penalty": [1.0], "repetition_penalty": [1.2], "return_log_probs": [True],
                       "num_top_log_probs": [2], "exclude_input_in_output": [True], "draft_model": ["ngram", "suffix"],
                       "guided_decoding_guide_type": ["regex"], "guided_decoding_guide": ["[a-z ]{1,12}"],
                       "stop_words": ["e"], "bad_words": ["the"], "end_id": [0], "pad_id": [0]}
    tokenizer = [{"model": model, "prompt": "Hello there"}, {"model": model, "messages": messages,
                                                               "add_generation_prompt": True}]
    triton = [
        {"text_input": "The sea is", "max_tokens": MAX_TOKENS, "temperature": 0.0},
        {"text_input": "Count:", "max_tokens": MAX_TOKENS, "num_draft_tokens": 3, "seed": 2,
         "temperature": 0.9, "top_p": 0.9, "return_log_probs": True},
    ]
    sampling = {"temperature": [0, 0.4, 1.0, 1.7], "top_p": [0.05, 0.5, 1.0], "top_k": [-1, 1, 3, 50],
                "min_p": [0.0, 0.2], "seed": [0, 9, 2 ** 32 + 1], "presence_penalty": [-2.0, 0.0, 1.5],
                "frequency_penalty": [-1.0, 2.0], "repetition_penalty": [0.8, 1.3], "stop": ["\n", [".", "e"], []],
                "max_tokens": [1, 2, 8, MAX_TOKENS], "min_tokens": [0, 4, MAX_TOKENS], "ignore_eos": [True, False],
                "stream": [True, False], "n": [1, 2, 3], "logprobs": [True, False], "top_logprobs": [0, 1, 5],
                "logit_bias": [{"0": 100}, {"5": -100, "7": 50}], "num_draft_tokens": [0, 1, 4, 8],
                "stream_options": [{"include_usage": True, "continuous_usage_stats": True}],
                "skip_special_tokens": [False], "include_stop_str_in_output": [True], "priority": [-5, 5],
                "response_format": [{"type": "json_object"}, {"type": "text"}], "guided_choice": [["a", "bb"]],
                "bad_words": [["the", "a"]], "return_token_ids": [True], "truncate_prompt_tokens": [1, 4],
                "use_beam_search": [False], "length_penalty": [1.0, 0.5], "early_stopping": [False, "never"]}
    chat_features = {**sampling, "echo": [True], "reasoning_effort": ["low"], "parallel_tool_calls": [False],
                     "add_generation_prompt": [False], "continue_final_message": [True], "user": ["u-1"],
                     "messages.0.content": ["", "A much longer instruction, in several words. " * 20]}
    text_features = {**{k: v for k, v in sampling.items() if k != "top_logprobs"},  # (chat's; completions: logprobs)
                     "echo": [True, False], "logprobs": [0, 1, 3], "prompt_logprobs": [0, 2],
                     "suffix": [None], "best_of": [1, 2], "prompt": ["", "x" * 3000, [1, 2, 3], [[7], [8, 9]]]}
    return [
        Endpoint("chat", "openai", "/v1/chat/completions", chat, features=chat_features),
        Endpoint("completions", "openai", "/v1/completions", completions, features=text_features),
        Endpoint("responses", "openai", "/v1/responses", responses, stream_end="", features={
            "temperature": [0, 1.2], "top_p": [0.3], "stream": [True, False], "max_output_tokens": [1, 8],
            "truncation": ["auto", "disabled"], "store": [False], "include": [["reasoning.encrypted_content"]],
            "tool_choice": ["none", "required"], "parallel_tool_calls": [False], "top_logprobs": [0, 3],
            "text": [{"format": {"type": "json_object"}}, {"verbosity": "medium"}], "metadata": [{"k": "v"}]}),
        Endpoint("messages", "openai", "/v1/messages", anthropic, stream_end="", features={
            "temperature": [0, 0.9], "top_k": [1, 40], "top_p": [0.5], "stop_sequences": [["e", "."], []],
            "stream": [True, False], "max_tokens": [1, MAX_TOKENS], "thinking": [{"type": "disabled"}],
            "tool_choice": [{"type": "auto"}, {"type": "any"}, {"type": "none"}], "metadata": [{"user_id": "u"}],
            "system": [[{"type": "text", "text": "Answer."}]]}),
        Endpoint("messages/count_tokens", "openai", "/v1/messages/count_tokens",
                 [{k: v for k, v in seed.items() if k not in ("max_tokens", "stream", "stop_sequences", "temperature")}
                  for seed in anthropic]),
        Endpoint("sglang generate", "openai", "/generate", sglang, features={
            **{f"sampling_params.{key}": values for key, values in {
                "temperature": [0, 0.8], "top_k": [1, -1], "top_p": [0.5], "min_p": [0.1], "stop": ["\n", ["a"]],
                "max_new_tokens": [0, 1, MAX_TOKENS], "min_new_tokens": [2], "ignore_eos": [True],
                "stop_token_ids": [[5, 6]], "n": [2], "regex": ["[a-c]+"], "json_schema": ['{"type": "object"}'],
                "repetition_penalty": [1.2], "presence_penalty": [1.0], "skip_special_tokens": [False]}.items()},
            "return_logprob": [True], "top_logprobs_num": [0, 3], "logprob_start_len": [0, -1], "stream": [True, False],
            "text": [["one", "two"]], "return_text_in_logprobs": [True], "rid": ["r-1"]}),
        Endpoint("tokenize", "openai", "/tokenize", tokenizer),
        Endpoint("detokenize", "openai", "/detokenize", [{"model": model, "tokens": [464, 5521, 314]}]),
        Endpoint("sagemaker invocations", "openai", "/invocations", [chat[0], completions[0]]),
        Endpoint("conversations", "openai", "/v1/conversations", [
            {"items": [{"type": "message", "role": "user", "content": "Say hello."}], "metadata": {"topic": "x"}}]),
        Endpoint("triton grpc", "grpc", "ensemble", []),  # (tensors: tensor_request)
        Endpoint("triton generate", "http", "/v2/models/ensemble/generate", triton, frontend_500=TRITON_PARSE_ERRORS,
                 features=triton_features),
        Endpoint("triton generate_stream", "http", "/v2/models/ensemble/generate_stream", triton, stream_end="",
                 frontend_500=TRITON_PARSE_ERRORS, features=triton_features),
    ]


# Values a mutation puts in place of another: wrong types, the edges of every numeric range, and strings that
# break naive handling (a lone surrogate cannot be encoded as UTF-8; a NUL; a very long one).
ODD_VALUES = [None, True, False, 0, -1, 1, 2, 7, -2 ** 31, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 63) - 1, 10 ** 40,
              0.5, -0.5, 1e-300, 1e308, -1e308, math.nan, math.inf, -math.inf, "", "x", "0", "-1", "null", "\u0000",
              "\ud800", "é" * 3, "a" * 20000, "<|im_end|>", [], [None], [[]], [0, -1], ["x"], {}, {"": None},
              {"type": None}, {"a": {"b": [1]}}]


def _paths(node, path=()):
    """Every (path, value) in a JSON tree, the root first."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, path + (i,))


def _set(tree, path, value):
    if not path:
        return value
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return tree


def _parent(tree, path):
    node = tree
    for key in path[:-1]:
        node = node[key]
    return node


def mutate(body: dict, rng: random.Random) -> tuple[object, str]:
    """(a mutated copy of body, what was done): one to three mutations at random places."""
    tree, done = copy.deepcopy(body), []
    for _ in range(rng.choice((1, 1, 2, 3))):
        places = list(_paths(tree))
        path, node = rng.choice(places[1:] or places)
        where = "/".join(map(str, path)) or "(body)"
        kind = rng.random()
        if kind < 0.55:
            value = rng.choice(ODD_VALUES)
            if isinstance(node, (int, float)) and not isinstance(node, bool) and rng.random() < 0.5:
                value = rng.choice((0, -1, node * 1000, -node, node + 0.5, 2 ** 31 - 1, 2 ** 32))
            tree = _set(tree, path, copy.deepcopy(value))
            done.append(f"{where} = {_short(value)}")
        elif kind < 0.7 and path and isinstance(_parent(tree, path), dict):
            del _parent(tree, path)[path[-1]]
            done.append(f"{where} removed")
        elif kind < 0.8 and isinstance(node, dict):
            key = rng.choice(("extra", "type", "role", "content", "model", "", "stream", "n", "logprobs"))
            node[key] = copy.deepcopy(rng.choice(ODD_VALUES))
            done.append(f"{where}/{key} = {_short(node[key])}")
        elif kind < 0.9 and isinstance(node, list):
            if node and rng.random() < 0.5:
                node.extend(copy.deepcopy(node) * rng.choice((1, 3)))
                done.append(f"{where} repeated")
            else:
                node.clear()
                done.append(f"{where} emptied")
        else:  # wrapped a level deeper: a value where its list or object was expected, or the other way
            tree = _set(tree, path, copy.deepcopy([node] if rng.random() < 0.5 else {"value": node}))
            done.append(f"{where} wrapped")
    return tree, "; ".join(done)


def combine(body: dict, features: dict[str, list], rng: random.Random) -> tuple[dict, str]:
    """(a copy of body with one to four of the endpoint's valid settings set, what was set)."""
    tree, done = copy.deepcopy(body), []
    for key in rng.sample(sorted(features), min(len(features), rng.randint(1, 4))):
        value = copy.deepcopy(rng.choice(features[key]))
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else (
                node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else None)
        if isinstance(node, dict):
            node[last] = value
            done.append(f"{key} = {_short(value)}")
    return tree, "; ".join(done) or "(as seeded)"


def surrogate_probe(body: dict) -> dict:
    """body with a lone surrogate before every string but those that name things (the model, a role, a
    type, a tool): the text a tokenizer, a chat template or an encoder gets (each endpoint's once, first)."""
    tree = copy.deepcopy(body)
    for path, value in list(_paths(tree)):
        if isinstance(value, str) and path and path[-1] not in ("model", "role", "type", "name"):
            _set(tree, path, "\ud800" + value)
    return tree


def broken_body(rng: random.Random) -> tuple[bytes, str]:
    """A body that is not a JSON object at all."""
    return rng.choice([
        (b"", "empty body"), (b"{", "truncated JSON"), (b"[]", "a list"), (b"null", "null"), (b"12", "a number"),
        (b'"text"', "a string"), (b"\xff\xfe{}", "not UTF-8"), (b"[" * 100000 + b"]" * 100000, "nested 100000 deep"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "objects nested 5000 deep"), (b'{"model": NaN}', "NaN"),
        (b'{"prompt": "x", "prompt": 1}', "a key twice")])


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Finding:
    endpoint: str
    what: str
    request: str
    answer: str


@dataclass
class Tally:
    answered: int = 0
    refused: int = 0
    frontend: int = 0  # refused by the server's frontend with a 500 (Endpoint.frontend_500)
    findings: list[Finding] = field(default_factory=list)


async def _read_stream(response: aiohttp.ClientResponse, endpoint: Endpoint) -> str | None:
    """None when the stream ended as it should; else what was wrong."""
    last, text = "", ""
    async for raw in response.content:
        line = raw.decode(errors="replace").strip()
        text = line or text
        if line.startswith("data:"):
            last = line[5:].strip()
    if endpoint.stream_end and last != endpoint.stream_end and '"error"' not in last:
        return f"the stream ended without {endpoint.stream_end}: last data {last[:200]!r}"
    return None


async def send(session: aiohttp.ClientSession, base: dict[str, str], endpoint: Endpoint, body: bytes,
               timeout_s: float) -> tuple[str, str | None, str]:
    """(outcome "answered"/"refused"/"frontend"/"finding", what was wrong, the answer's start) of one request."""
    url = base[endpoint.port] + endpoint.path
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            status = response.status
            if status == 200 and response.content_type == "text/event-stream":
                problem = await _read_stream(response, endpoint)
                return ("finding", problem, "(stream)") if problem else ("answered", None, "")
            text = await response.text(errors="replace")
    except asyncio.TimeoutError:
        return "finding", f"no answer within {timeout_s:.0f} s", ""
    except aiohttp.ClientError as exc:
        return "finding", f"the connection failed: {exc!r}", ""
    if status < 300:
        try:
            json.loads(text)
        except ValueError:
            return "finding", f"{status} with a body that is not JSON", text[:300]
        return "answered", None, ""
    if status >= 500 and status != 503:
        if status == 500 and _has_message(text) and any(m in text for m in endpoint.frontend_500):
            return "frontend", None, text[:300]
        return "finding", f"HTTP {status}", text[:500]
    if not _has_message(text):
        return "finding", f"HTTP {status} without a JSON error message", text[:300]
    return "refused", None, ""


def _has_message(text: str) -> bool:
    """Whether an error body says what was wrong: OpenAI's, Anthropic's, SGLang's or Triton's error shapes (the
    last as one server-sent event where the stream was asked for)."""
    if text.startswith("data:"):
        text = text[5:].split("\n", 1)[0]
    try:
        body = json.loads(text)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    if error is None and isinstance(body, dict) and isinstance(body.get("detail"), str):
        error = body["detail"]
    return isinstance(error, str) and bool(error.strip())


async def ready(session: aiohttp.ClientSession, base: dict[str, str], wait_s: float) -> str | None:
    """None once both front doors answer ready (within wait_s); else what did not."""
    deadline, problem = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        problem = None
        for url in (base["openai"] + "/health", base["http"] + "/v2/health/ready"):
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
                    if response.status != 200:
                        problem = f"{url}: HTTP {response.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                problem = f"{url}: {exc!r}"
        if problem is None:
            return None
        await asyncio.sleep(0.5)
    return problem


LIVE_METRICS = ("specdec_live_sequences", "specdec_model_live_sequences")


async def counts(session: aiohttp.ClientSession, metrics_url: str) -> tuple[float, float]:
    """(the server's live generations and the models' live sequences, summed; the requests the orchestrators
    failed with an error they did not foresee: a fault of theirs or a model's stub that died)."""
    from specdec.serving.metrics_text import sum_samples  # (the package: only where a server is fuzzed)
    async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        text = await response.text()
    return (sum(sum_samples(text, name) for name in LIVE_METRICS),
            sum_samples(text, "specdec_requests_total", finish_reason="error"))


# ---- Triton's gRPC API: the ensemble's inputs as tensors ----------------------------------------------------
NUMPY_TYPES = {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
               "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32}
# Each type's values at and past its inputs' ranges: bytes that are no UTF-8, JSON of every kind, NaN
TENSOR_VALUES = {
    "TYPE_STRING": [b"", b"x", b"\xff\xfe", b"\x00", b"{", b"[]", b"{}", b"null", b'{"a": [1, {"b": null}]}',
                    b'[{"role": "user", "content": "hi"}]', b'"text"', b"a" * 20000, b"ngram", b"regex", b"json",
                    b"[a-z]+", b"<|im_end|>", b"[" * 3000, b'{"type": "object"}', b"none", b"\xed\xa0\x80"],
    "TYPE_BOOL": [True, False],
    "TYPE_INT32": [0, -1, 1, 3, 16, 64, 1024, 4096, 2 ** 31 - 1, -2 ** 31],
    "TYPE_INT64": [0, -1, 1, 2 ** 62, -2 ** 63],
    "TYPE_UINT64": [0, 1, 2 ** 64 - 1],
    "TYPE_FP32": [0.0, -1.0, 0.5, 1.0, 2.5, 1e30, math.nan, math.inf, -math.inf, 1e-45]}
GRPC_SEED = {"text_input": np.array([[b"The sea is"]], dtype=np.object_), "max_tokens": np.array([[MAX_TOKENS]],
                                                                                                  dtype=np.int32)}


def tensor_request(inputs: list[dict], rng: random.Random) -> tuple[dict[str, np.ndarray], str]:
    """The ensemble's inputs (from its config: name, data_type, dims): a prompt and max_tokens, and one to
    five of its inputs at random with values of their type (past their ranges too), now and then of another
    type, another shape or a batch of two (one input's, or the whole request's)."""
    arrays, done = dict(GRPC_SEED), []
    for spec in rng.sample(inputs, min(len(inputs), rng.randint(1, 5))):
        kind, roll = spec["data_type"], rng.random()
        if kind not in NUMPY_TYPES:
            continue
        if roll < 0.1:
            kind = rng.choice(sorted(NUMPY_TYPES))  # another type than the input's
        value = rng.choice(TENSOR_VALUES[kind])
        length = rng.randint(0, 5) if any(int(d) < 0 for d in spec.get("dims", [1])) else 1
        array = np.array([[value] * length], dtype=NUMPY_TYPES[kind])
        if roll > 0.93:
            array = np.concatenate([array, array])  # a batch of two
        elif roll > 0.88:
            array = array.reshape(1, 1, -1)  # a dimension too many
        arrays[spec["name"]] = array
        done.append(f"{spec['name']} = {_short(value if not isinstance(value, bytes) else value.decode('latin-1'))}"
                    f" ({kind[5:].lower()}, {list(array.shape)})")
    roll = rng.random()
    if roll < 0.1:
        del arrays["text_input"]
        done.append("text_input removed")
    elif roll < 0.15 and all(array.shape[0] == 1 for array in arrays.values()):
        arrays = {name: np.concatenate([array, array]) for name, array in arrays.items()}
        done.append("every input a batch of two")
    return arrays, "; ".join(done)


# Triton 24.10's ensemble keeps some requests live that Triton refused for their tensors over a gRPC stream (a
# tensor of another type than its input's, every time; among other refusals of types, shapes and batch sizes,
# now and then): the server serves on, but stopping it waits out its exit timeout (30 s) and exits 1. Sent to
# speculative_decoding itself, not. The test sends no tensors (the session's server must stop cleanly); the
# command line does (docs/results/2026-12-07-fuzzing.md).

# Markers of a refusal that says what was wrong, in the server's words: the orchestrator's and the models'
# ("input 'NAME' ..."), Triton's own checks of types and shapes ("inference input", "unexpected ... input")
REFUSAL_MARKERS = ("input '", "inputs '", "inference input", "unexpected inference input", "parameter '", "expected ",
                   "request has 0 inputs")


async def send_tensors(grpc_url: str, arrays: dict[str, np.ndarray], timeout_s: float, model: str = "ensemble"
                       ) -> tuple[str, str | None, str]:
    """(outcome, what was wrong, the answer's start) of one streamed gRPC request to `model`."""
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)

    async def requests():
        yield {"model_name": model, "inputs": inputs, "enable_empty_final_response": True}

    async with grpcclient.InferenceServerClient(grpc_url) as client:
        responses = client.stream_infer(requests())
        try:
            async with asyncio.timeout(timeout_s):
                async for result, error in responses:
                    if error is not None:
                        message = error.message() if hasattr(error, "message") else str(error)
                        if any(marker in message for marker in REFUSAL_MARKERS):
                            return "refused", None, ""
                        return "finding", "an error that names no input", message[:500]
                    final = result.get_response().parameters.get("triton_final_response")
                    if final and final.bool_param:
                        return "answered", None, ""
            return "finding", "the stream ended without its final response", ""
        except TimeoutError:
            responses.cancel()
            return "finding", f"no final response within {timeout_s:.0f} s", ""
        except InferenceServerException as exc:
            return "finding", f"the stream failed: {exc.message()}", ""


async def fuzz(base: dict[str, str], metrics_url: str, requests: int, seed: int, concurrency: int,
               timeout_s: float, broken_fraction: float = 0.08, odd_fraction: float = 0.6, log=print,
               only: frozenset[str] = frozenset()) -> dict[str, Tally]:
    """Send `requests` mutated requests, `concurrency` at a time; returns each endpoint's tally. A server that
    does not come back ready after a batch, or generations left live after the last, are findings of "server"."""
    rng = random.Random(seed)
    tallies: dict[str, Tally] = {}
    async with aiohttp.ClientSession() as session:
        async with session.get(base["openai"] + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        targets = [e for e in endpoints(model) if e.port in base and (not only or e.name in only)]
        async with session.get(base["http"] + "/v2/models/ensemble/config") as response:
            tensor_inputs = (await response.json())["input"]
        live_before, errors_before = await counts(session, metrics_url)
        server = tallies.setdefault("server", Tally())
        plan = [(endpoint, json.dumps(surrogate_probe(endpoint.seeds[0])).encode("utf-8", errors="surrogatepass"),
                 "a lone surrogate in every text") for endpoint in targets if endpoint.seeds]
        for _ in range(requests):
            endpoint = rng.choice(targets)
            if endpoint.port == "grpc":
                arrays, what = tensor_request(tensor_inputs, rng)
                plan.append((endpoint, arrays, what))
                continue
            if rng.random() < broken_fraction:
                body, what = broken_body(rng)
            else:
                tree, what = combine(rng.choice(endpoint.seeds), endpoint.features, rng)
                if rng.random() < odd_fraction or not endpoint.features:
                    tree, odd = mutate(tree, rng)
                    what = f"{what}; {odd}"
                body = json.dumps(tree).encode("utf-8", errors="surrogatepass")
            plan.append((endpoint, body, what))
        for start in range(0, len(plan), concurrency):
            batch = plan[start:start + concurrency]
            outcomes = await asyncio.gather(*(
                send_tensors(base["grpc"], b, timeout_s) if e.port == "grpc" else send(session, base, e, b, timeout_s)
                for e, b, _ in batch))
            for (endpoint, body, what), (outcome, problem, answer) in zip(batch, outcomes):
                tally = tallies.setdefault(endpoint.name, Tally())
                if outcome == "finding":
                    request = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else "(tensors)"
                    tally.findings.append(Finding(endpoint.name, problem, f"{what}: {request[:400]}", answer))
                else:
                    setattr(tally, outcome, getattr(tally, outcome) + 1)
            problem = await ready(session, base, wait_s=60)
            if problem:
                server.findings.append(Finding("server", "not ready after a batch", "; ".join(w for _, _, w in batch),
                                               problem))
                break
            if (start // concurrency) % 25 == 0:
                log(f"[fuzz] {start + len(batch)}/{len(plan)} sent")
        deadline = time.monotonic() + 30
        while (left := await counts(session, metrics_url))[0] > live_before and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        if left[0] > live_before:
            server.findings.append(Finding("server", "generations left live 30 s after the last request", "",
                                           f"{left[0]:.0f} live (before: {live_before:.0f})"))
        if left[1] > errors_before:
            server.findings.append(Finding("server", "requests failed with an error the server did not foresee", "",
                                           f"{left[1] - errors_before:.0f} (specdec_requests_total{{finish_reason="
                                           f"\"error\"}}; the server's log has each one's traceback)"))
    return tallies


def report(tallies: dict[str, Tally]) -> tuple[str, list[Finding]]:
    rows = [(name, t.answered, t.refused, t.frontend, len(t.findings)) for name, t in tallies.items()]
    findings = [f for t in tallies.values() for f in t.findings]
    headers = ("endpoint", "answered", "refused", "refused by Triton's frontend with a 500", "findings")
    return tabulate(rows, headers=headers, tablefmt="github"), findings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's host (its ports: --openai-port, --http-port, "
                                      "--metrics-port)")
    parser.add_argument("--openai-port", type=int, default=9000)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--pair", default="tiny", help="without --url: start a server of this pair")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120, help="seconds a request may take")
    parser.add_argument("--endpoints", default="", help="these endpoints alone (names as the table has them, "
                                                        "comma-separated)")
    args = parser.parse_args(argv)
    proc = None
    if args.url:
        host, ports = args.url, (args.openai_port, args.http_port, args.metrics_port, args.grpc_port)
    else:
        import tempfile
        from pathlib import Path

        from specdec.serving import server as serving
        tmp = Path(tempfile.mkdtemp(prefix="specdec-fuzz-"))
        proc = serving.start(tmp / "run", tmp / "tritonserver.log", ["--pair", args.pair])
        host, ports = "localhost", (proc.openai_port, proc.http_port, proc.metrics_port, proc.grpc_port)
        print(f"[fuzz] server of the {args.pair} pair; its log: {tmp / 'tritonserver.log'}")
    try:
        base = {"openai": f"http://{host}:{ports[0]}", "http": f"http://{host}:{ports[1]}",
                "grpc": f"{host}:{ports[3]}"}
        tallies = asyncio.run(fuzz(base, f"http://{host}:{ports[2]}/metrics", args.requests, args.seed,
                                   args.concurrency, args.timeout,
                                   only=frozenset(filter(None, args.endpoints.split(",")))))
    finally:
        if proc is not None:
            proc.stop(timeout_s=90)
    table, findings = report(tallies)
    print(table)
    for finding in findings:
        print(f"\n[{finding.endpoint}] {finding.what}\n  request: {finding.request}\n  answer: {finding.answer}")
    if proc is not None and not findings:  # (its log kept where it has something to say)
        shutil.rmtree(proc.run_dir.parent, ignore_errors=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
