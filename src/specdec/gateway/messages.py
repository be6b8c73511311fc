"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), on the chat path: a
request becomes the chat request it stands for (protocol.parse_chat checks and maps that onto the ensemble's
inputs), its answer a `message` with content blocks (text, tool_use, a reasoning model's thinking), streamed
as the Messages API's events; errors in Anthropic's form. What Claude Code and the `anthropic` SDK send.
Pure. docs/openai.md (Anthropic's Messages API).
"""

from __future__ import annotations

import datetime
import json

from specdec.gateway import tools
from specdec.gateway.protocol import CHAT_FIELDS, STATS_FIELD, ApiError, Generation, invalid, joined_text, json_line

# Hints that change nothing here: prompt caching (automatic here: prefix caching), where and how fast Anthropic
# runs a request, who asks, a code tool's container
IGNORED = ("metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
           "workspace_id", "container")
# The Messages API's own fields (temperature, top_p and top_k as older clients send them); this server's and
# vLLM's sampling extras (min_p, ignore_eos, num_draft_tokens, ...) are taken as the chat takes them
OWN_FIELDS = ("model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p",
              "top_k", "tools", "tool_choice", "thinking", "output_config", *IGNORED)
CHAT_ONLY = {"messages", "max_completion_tokens", "response_format", "n", "logprobs", "top_logprobs",
             "stream_options", "functions", "function_call", "reasoning_effort", "tools", "tool_choice", "stop",
             "parallel_tool_calls", "user", "echo"}
EXTRA_FIELDS = tuple(name for name in CHAT_FIELDS if name not in CHAT_ONLY and name not in OWN_FIELDS)
# count_tokens' body
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control",
                "speed", "user_profile_id", "workspace_id")
ANTHROPIC_VERSION_HEADER = "anthropic-version"  # every Anthropic client sends it
TOOL_USE_PREFIX = "toolu_"  # a tool_use block's id starts so, as Anthropic's do
# A chat field named in an error -> the Messages field it came from
RENAMED = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort"}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """An error in Anthropic's form (its message names the field, as the chat path's do)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def renamed(error: ApiError) -> ApiError:
    """An error about the chat request, about the Messages request it came from."""
    if error.param in RENAMED:
        name = RENAMED[error.param]
        return ApiError(error.status, error.message.replace(error.param, name, 1), name, error.code)
    return error


def _text_blocks(content, where: str) -> str:
    """A string, or a list of text blocks, as one text (a block named as Anthropic names them: where.j)."""
    return joined_text(content, where, ("text",), "text blocks", lambda j: f"{where}.{j}")


def chat_messages(body: dict) -> list[dict]:
    """`system` and `messages` as a chat's messages: text blocks as the message's text, an assistant's
    tool_use blocks as its tool_calls, a user's tool_result blocks as tool messages (before the user's text,
    which follows the results); thinking blocks sent back are left out, as chat templates leave them out."""
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise invalid("messages", "is required: a non-empty list of messages")
    for i, message in enumerate(given):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise invalid(f"{where}.role", "must be user or assistant")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content", "must be a string or a list of content blocks")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise invalid(f"{at}.text", "must be a string")
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input"), dict):
                    raise invalid(at, "a tool_use block needs id, name (strings) and input (an object)")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise invalid(f"{at}.tool_use_id", "must be the id of the tool_use it answers")
                result = _text_blocks(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise invalid(f"{at}.type", f"{json.dumps(kind)[:40]} is not supported in a {role} message here "
                                            f"(text; tool_use from the assistant, tool_result from the user)")
        out += results
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not results:
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tools(body: dict) -> dict:
    """`tools` and `tool_choice` in the chat's form."""
    out = {}
    given = body.get("tools")
    if given is not None:
        if not isinstance(given, list):
            raise invalid("tools", "must be a list of tools")
        out["tools"] = []
        for i, tool in enumerate(given):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise invalid(f"tools.{i}.type", "only custom tools (name, description, input_schema) are supported "
                                                 "here")
            if not isinstance(tool.get("name"), str):
                raise invalid(f"tools.{i}.name", "must be a string")
            function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            if tool.get("strict") is not None:  # Anthropic's strict tool use: the calls held to input_schema
                function["strict"] = tool["strict"]
            out["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is None:
        return out
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice.type", "must be auto, any, tool or none")
    if choice["type"] in ("any", "tool") and not given:
        raise invalid("tool_choice", f"{choice['type']} needs tools to choose from")
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name", "must name a tool")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif given:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _thinking(body: dict, budgets: bool) -> dict:
    """`thinking` as the chat template's `enable_thinking` (what Qwen3's and GLM's templates read) and
    `thinking` (DeepSeek-V3.1's; templates ignore a variable they do not read), and its `budget_tokens` as the
    chat's thinking_token_budget where the server reads the thinking (`budgets`: it has a reasoning parser;
    elsewhere max_tokens bounds the thinking and the answer together)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive",
                                                                      "between_tools"):
        raise invalid("thinking.type", "must be enabled, disabled, adaptive or between_tools")
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs.setdefault("enable_thinking", thinking["type"] != "disabled")
    kwargs.setdefault("thinking", thinking["type"] != "disabled")
    budget = thinking.get("budget_tokens") if thinking["type"] == "enabled" else None
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise invalid("thinking.budget_tokens", f"must be an integer >= 0, got {json.dumps(budget)[:40]}")
    return {"chat_template_kwargs": kwargs, **({"thinking_token_budget": budget} if budgets and budget is not None
                                               else {})}


def _output_config(body: dict) -> dict:
    """`output_config`: its JSON schema `format` as the chat's structured output, its `effort` as the chat's
    reasoning_effort (the chat template's variable)."""
    config = body.get("output_config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise invalid("output_config", "must be an object")
    out = {}
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise invalid("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": {...}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        out["reasoning_effort"] = config["effort"]
    return out


def chat_body(body, count: bool = False, budgets: bool = False) -> dict:
    """A /v1/messages body -> the /v1/chat/completions body it stands for (ApiError naming the field); an
    assistant message last is the answer's beginning (Anthropic's prefill), which the model continues (vLLM's
    continue_final_message).
    count: a count_tokens body (no max_tokens; only what the prompt is made of). budgets: the server reads the
    model's thinking (a reasoning parser), so a thinking budget is enforced."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = COUNT_FIELDS if count else OWN_FIELDS + EXTRA_FIELDS
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise invalid(unknown[0], "unrecognized request argument (not supported by this server)")
    if not count and body.get("max_tokens") is None:
        raise invalid("max_tokens", "is required")
    chat = {key: value for key, value in body.items() if key not in (
        "system", "messages", "tools", "tool_choice", "thinking", "stop_sequences", "output_config", *IGNORED)}
    chat["messages"] = chat_messages(body)
    last = chat["messages"][-1] if chat["messages"] else {}
    if last.get("role") == "assistant" and not last.get("tool_calls"):  # a prefilled answer: continued
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise invalid("stop_sequences", "must be a list of strings")
        chat["stop"] = body["stop_sequences"]
    if count:
        chat["max_tokens"] = 1
    return {**chat, **_tools(body), **_thinking(body, budgets and not count), **_output_config(body)}


def stop_reason(reason: str | None, called: bool, stop_sequence: str | None) -> str:
    """The message's stop_reason from the server's finish reason (OpenAI's form)."""
    if called:
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(generated: str, sent: str, sequences: list[str] | None) -> str | None:
    """Which stop sequence ended an answer: the one found earliest in the generated text (`generated`, every
    token decoded) at or after the end of the text sent (`sent`, cut before it); None when none was."""
    found = [(generated.find(s, len(sent)), s) for s in sequences or [] if s]
    found = [(at, s) for at, s in found if at >= 0]
    return min(found)[1] if found else None


def tool_use_block(call: dict) -> dict:
    """A call {"name", "arguments": a JSON string} as a tool_use block (its input the arguments parsed)."""
    try:
        arguments = json.loads(call["arguments"]) if call["arguments"].strip() else {}
    except ValueError:  # a call cut short (max_tokens): its input as far as it was written
        arguments = {"_partial_arguments": call["arguments"]}
    return {"type": "tool_use", "id": TOOL_USE_PREFIX + tools.call_id().removeprefix("call_"),
            "name": call["name"], "input": arguments if isinstance(arguments, dict) else {"value": arguments}}


def content_blocks(text: str | None, calls: list[dict], thinking: str | None = None) -> list[dict]:
    """A whole answer's content: its thinking, its text (when it has any), its tool calls."""
    blocks = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + [tool_use_block(call) for call in calls]


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: the prompt's tokens the server's prefix cache held are read from the cache, the rest
    are input (theirs add up to the prompt's); every block the server computes is kept for later prompts,
    which nothing bills: no cache writes."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def message_object(gen: Generation, content: list[dict], reason: str | None, stop_sequence: str | None,
                   usage: dict, stats: dict | None = None) -> dict:
    """The `message` answer (reason None: still generating, as message_start carries it); `usage`'s."""
    out = {"id": "msg_" + gen.id, "type": "message", "role": "assistant", "model": gen.model, "content": content,
           "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage}
    if stats is not None:
        out[STATS_FIELD] = stats
    return out


def model_card(name: str, created: int) -> dict:
    """A model's fields as Anthropic's model list gives them."""
    stamp = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "display_name": name, "created_at": stamp}


def event(kind: str, **fields) -> bytes:
    """One streamed event, as Anthropic sends them (its type as the SSE event name and in the data)."""
    data = json_line({"type": kind, **fields})
    return f"event: {kind}\ndata: {data}\n\n".encode("utf-8")
