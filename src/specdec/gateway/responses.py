"""OpenAI's Responses API (`POST /v1/responses`), on the chat path: a request becomes the chat request it
stands for (protocol.parse_chat checks and maps that onto the ensemble's inputs), its answer a `response`
object, streamed as the Responses API's events. Pure: the stored responses that `previous_response_id`
continues are response_store.py's. docs/openai.md.
"""

from __future__ import annotations

import json
import uuid

from specdec.gateway import tools
from specdec.gateway.protocol import (CHAT_FIELDS, IGNORED_FIELDS, STATS_FIELD, ApiError, Generation, check_verbosity,
                                      invalid, joined_text, renamed_message)

# What the Responses API names differently, or has and chat has not; the rest of the chat's fields (OpenAI's
# sampling settings, vLLM's extras, this server's speculative settings) are taken as chat takes them.
OWN_FIELDS = ("input", "instructions", "max_output_tokens", "text", "previous_response_id", "truncation",
              "reasoning", "include", "background", "max_tool_calls", "top_logprobs", "conversation", "stream_options")
CHAT_ONLY = {"messages", "max_tokens", "max_completion_tokens", "response_format", "n", "logprobs", "top_logprobs",
             "stream_options", "functions", "function_call", "reasoning_effort", "verbosity"}
FIELDS = (*OWN_FIELDS, *(name for name in CHAT_FIELDS if name not in CHAT_ONLY), *IGNORED_FIELDS)
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # `include`: the output text's log-probabilities
# `include` that stateless agent clients send for reasoning models: a reasoning item here has no encrypted
# content (the thinking is plain text), so asking for it changes nothing
ENCRYPTED_REASONING = "reasoning.encrypted_content"
# A chat field named in an error -> the Responses field it came from
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


def renamed(error: ApiError) -> ApiError:
    """An error about the chat request, about the Responses request it came from."""
    param = error.param
    if not param:
        return error
    head, dot, rest = param.partition(".")
    head, bracket, index = head.partition("[")
    param = RENAMED.get(head, head) + (bracket + index) + (dot + rest)
    return ApiError(error.status, renamed_message(error.message, error.param, param), param, error.code)


def _text(content, where: str) -> str:
    return joined_text(content, f"{where}.content", ("input_text", "output_text", "text"),
                       "text parts (input_text, output_text)")


def input_messages(body: dict) -> list[dict]:
    """`input` as a chat's messages: messages by role, function calls as the assistant's tool_calls, their
    outputs as tool messages (what a stored response keeps of its input: not its `instructions`)."""
    messages = []
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise invalid("input", "is required: a string or a non-empty list of input items")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", "must be user, system, developer or assistant")
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise invalid(where, "a function_call needs call_id, name and arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # an earlier answer's thinking, sent back: chat templates leave it out
            continue
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise invalid(where, "a function_call_output needs call_id and output (strings)")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            raise invalid(f"{where}.type", f"{json.dumps(kind)[:40]} is not supported (messages, function_call, "
                                            "function_call_output and reasoning are)")
    return messages


def input_items(body: dict) -> list[dict]:
    """A request's `input` (already checked by input_messages) as the items the API lists back: each with an
    id and a status, a message's content as text parts (input_text; an assistant's output_text)."""
    given = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            texts = [item["content"]] if isinstance(item["content"], str) else [p["text"] for p in item["content"]]
            content = [{"type": part, "text": text, **({"annotations": []} if part == "output_text" else {})}
                       for text in texts]
            items.append({"id": item.get("id") or "msg_" + uuid.uuid4().hex, "type": "message", "role": item["role"],
                          "status": "completed", "content": content})
        else:  # function_call, function_call_output, reasoning: as sent
            prefix = {"function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}[kind]
            extra = {"summary": []} if kind == "reasoning" else {"status": "completed"}
            items.append({**extra, **item, "id": item.get("id") or prefix + uuid.uuid4().hex})
    return items


def _tools(body: dict) -> dict:
    """`tools` and `tool_choice` in the chat's form (the Responses API's function tools are flat)."""
    out = {}
    given = body.get("tools")
    if given is not None:
        if not isinstance(given, list):
            raise invalid("tools", "must be a list of function tools")
        out["tools"] = []
        for i, tool in enumerate(given):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise invalid(f"tools[{i}].type", "only function tools are supported")
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            out["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if not given and choice == "auto":  # what agent SDKs send with no tools: nothing to choose from
        choice = None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict:
    """`text.format` as the chat's `response_format`."""
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise invalid("text", "must be an object")
    check_verbosity(text.get("verbosity"), "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise invalid("text.format", "must be an object")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "must be a JSON schema object")
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}}
    return {"response_format": {"type": fmt.get("type")}}


def checked(body) -> dict:
    """The fields whose checks come before a stored conversation is looked up (ApiError naming the field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(unknown[0], "unrecognized request argument (not supported by this server)")
    previous = body.get("previous_response_id")
    if body.get("conversation") is not None and previous is not None:
        raise invalid("conversation", "a response continues a conversation or a previous response, not both")
    if previous is not None and not isinstance(previous, str):
        raise invalid("previous_response_id", "must be a response's id (a string)")
    if body.get("store") not in (None, True, False):
        raise invalid("store", "must be true or false")
    if body.get("background") not in (None, True, False):
        raise invalid("background", "must be true or false")
    if body.get("background") and body.get("store") is False:
        raise invalid("background", "needs store: true (a background response is read back from the store)")
    return body


def truncating(body: dict) -> bool:
    """Whether the request asks `truncation: auto` (ApiError naming the field when it is neither)."""
    value = body.get("truncation")
    if value not in (None, "disabled", "auto"):
        raise invalid("truncation", f"must be auto or disabled, got {json.dumps(value)[:40]}")
    return value == "auto"


def turn_cuts(conversation: list[dict]) -> list[int]:
    """`truncation: auto`'s choices over a conversation's chat messages (the stored history, then this input):
    how many to drop, fewest first, each a whole number of its oldest turns. A turn is a user message and what
    follows it up to the next user message, so a tool call never loses its output; the conversation's leading
    system and developer messages are never dropped, nor its last turn."""
    head = _leading_system(conversation)
    return [0] + [i - head for i in range(head + 1, len(conversation)) if conversation[i]["role"] == "user"]


def _leading_system(conversation: list[dict]) -> int:
    head = 0
    while head < len(conversation) and conversation[head]["role"] in ("system", "developer"):
        head += 1
    return head


def chat_body(body: dict, history: list[dict] | None = None, dropped: int = 0) -> dict:
    """A /v1/responses body -> the /v1/chat/completions body it stands for (ApiError naming the field).
    history: the messages of the stored conversation `previous_response_id` continues (its instructions are
    not carried over, as OpenAI's are not: this request's own come first). dropped: how many of the
    conversation's messages `truncation: auto` leaves out (one of turn_cuts')."""
    checked(body)
    truncating(body)
    if body.get("max_tool_calls") is not None:
        raise invalid("max_tool_calls", "is not supported here")
    include = body.get("include") or []
    if not isinstance(include, list) or any(item not in (LOGPROBS_INCLUDE, ENCRYPTED_REASONING) for item in include):
        raise invalid("include", f"only {LOGPROBS_INCLUDE!r} (and {ENCRYPTED_REASONING!r}: there is none) is "
                                 f"supported here")
    logprobs = LOGPROBS_INCLUDE in include
    top = body.get("top_logprobs")
    if top not in (None, 0) and not logprobs:
        raise invalid("top_logprobs", f"needs include: [{LOGPROBS_INCLUDE!r}] (the log-probabilities it adds to)")
    reasoning = body.get("reasoning")  # clients send it unset ({"effort": null})
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid("reasoning", "must be an object")
    for key, value in (reasoning or {}).items():
        if key != "effort" and value is not None:
            raise invalid(f"reasoning.{key}", "is not supported here (a reasoning model's thinking comes whole, as a "
                                              "reasoning item, with the server's --reasoning-parser)")
    chat = {key: value for key, value in body.items() if key not in OWN_FIELDS and key not in ("tools", "tool_choice")}
    if (reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if logprobs:  # each token's log-probability (and top_logprobs' alternatives) on the message's text
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "must be a string")
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    conversation = list(history or []) + input_messages(body)
    head = _leading_system(conversation)
    chat["messages"] = system + conversation[:head] + conversation[head + dropped:]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return {**chat, **_tools(body), **_format(body)}


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat's assistant turn (what a stored response keeps of its answer):
    its message's text and its function calls; a thinking is left out, as chat templates leave it out."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text or (None if calls else "")}
    return [{**message, "tool_calls": calls} if calls else message]


def output_items(text: str | None, calls: list[dict], thinking: str | None = None,
                 logprobs: list[dict] | None = None) -> list[dict]:
    """A whole answer's output: a reasoning model's thinking (`--reasoning-parser`), its message (when it
    has text, or nothing called; `logprobs`: its tokens', the chat's entries) and its function calls."""
    items = [reasoning_item(thinking, "completed")] if thinking else []
    if text or not calls:
        items.append(message_item(text or "", "completed", logprobs=logprobs))
    items += [function_call_item(call) for call in calls]
    return items


def message_item(text: str, status: str, item_id: str | None = None, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": item_id or "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)] if status == "completed" else []}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict:
    """An output_text part; `logprobs`: the chat's per-token entries (token, logprob, bytes, top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(text: str | None, status: str, item_id: str | None = None) -> dict:
    """A reasoning model's thinking as a `reasoning` output item: its text as a reasoning_text part (no
    summary: the thinking is the model's own text)."""
    return {"type": "reasoning", "id": item_id or "rs_" + uuid.uuid4().hex, "status": status, "summary": [],
            "content": [reasoning_text(text)] if text is not None else []}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def function_call_item(call: dict) -> dict:
    """A call {"name", "arguments"} (tools.split_output's) as a function_call output item."""
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.get("id") or tools.call_id(),
            "name": call["name"], "arguments": call["arguments"], "status": "completed"}


def response_object(gen: Generation, body: dict, status: str, output: list[dict], usage: dict | None = None,
                    stats: dict | None = None, stored: bool = False) -> dict:
    """The `response` object (status in_progress, completed, incomplete, failed or cancelled), echoing
    the request's settings; stored: whether it is kept (for previous_response_id and GET /v1/responses/{id})."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    out = {"id": "resp_" + gen.id, "object": "response", "created_at": gen.created, "status": status,
           "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
           "model": gen.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
           "previous_response_id": body.get("previous_response_id"), "store": stored,
           "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
           "temperature": gen.sampling.get("temperature", body.get("temperature")), "text": {"format": fmt},
           "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
           "tools": body.get("tools") or [], "top_p": gen.sampling.get("top_p", body.get("top_p", 1.0)),
           "truncation": "auto" if body.get("truncation") == "auto" else "disabled",
           "usage": usage, "metadata": body.get("metadata") or {}, "background": bool(body.get("background")),
           "conversation": _conversation(body.get("conversation"))}
    if stats is not None:
        out[STATS_FIELD] = stats
    return out


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0) -> dict:
    """`cached_tokens`: of the input's, those the server's prefix cache held."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def _conversation(value) -> dict | None:
    """The conversation a response belongs to, as the response object names it."""
    if value is None:
        return None
    return {"id": value["id"] if isinstance(value, dict) else value}


def failed(response: dict, code: str, message: str) -> dict:
    """A background response that ended without its answer (`error` says why)."""
    return {**response, "status": "failed", "error": {"code": code, "message": message}}


PENDING = ("queued", "in_progress")  # a background response's states before its end


def ending_event(response: dict) -> str:
    """The event that ends a response's stream with the response as it ended."""
    return {"completed": "response.completed", "incomplete": "response.incomplete"}.get(response["status"],
                                                                                      "response.failed")


def status_of(finish_reason: str | None) -> str:
    """A finish reason (OpenAI's chat form) as the response's status."""
    return "incomplete" if finish_reason == "length" else "completed"


# The events that end a response's stream (a cancelled one's ends without one)
ENDING_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def event(kind: str, number: int, **fields) -> dict:
    """One streamed event: its type and its place in the response's stream."""
    return {"type": kind, "sequence_number": number, **fields}


def sse(event: dict) -> bytes:
    """An event as OpenAI sends it: its type as the SSE event name and in the data."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")
