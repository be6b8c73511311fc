"""vLLM's tokenizer endpoints, which evaluation and benchmark clients use to tokenize with the server's own
tokenizer (lm-eval's `local-completions` picks them up by itself: `tokenizer_backend=remote`, its default
`auto` when the server has them): `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`. Pure: a request
body and the tokenizer in, the response body out (ApiError naming the field otherwise). docs/openai.md.
"""

from __future__ import annotations

import json

from specdec import tensor_names as tn
from specdec.decoding.text import chat_ids, chat_messages as server_messages, chat_template_kwargs, chat_tools, \
    template_variables
from specdec.gateway.protocol import ApiError, chat_messages, continues, invalid, request_template, with_documents

# The special tokens a tokenizer_info answer names (vLLM's answer is the tokenizer's settings; these are
# what lm-eval's remote tokenizer reads of it, with the chat template).
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(name, "must be a boolean")
    return value


def tokenize(tokenizer, body: dict, max_model_len: int, trust_template: bool = False,
             content_format: str = "auto") -> dict:
    """`{"prompt": text}` (`add_special_tokens`, default true) or `{"messages": [...]}` (the chat template
    with the assistant's turn opened, or its last message continued with `continue_final_message`, over its
    `tools` and `documents`, as the chat endpoint renders it: `count` is its `prompt_tokens`; a
    request's own `chat_template` where the API trusts them) -> `{"count", "max_model_len", "tokens",
    "token_strs"}` (`token_strs` with `return_token_strs`). content_format: the server's (text.CONTENT_FORMATS)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise invalid("prompt", "send a prompt (a string) or messages, one of them")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise invalid("prompt", "must be a string")
        ids = tokenizer.encode(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        template = request_template(body, trust_template)
        if not getattr(tokenizer, "chat_template", None) and template is None:
            raise invalid("messages", "the model's tokenizer has no chat template")
        kwargs = body.get("chat_template_kwargs")
        try:
            kwargs = None if kwargs is None else template_variables(kwargs, "chat_template_kwargs")
        except ValueError as exc:
            raise invalid("chat_template_kwargs", str(exc)) from None
        kwargs = with_documents(body, kwargs)
        tools = body.get("tools") or None  # rendered as the chat endpoint renders them: the same count
        try:
            tools = None if tools is None else chat_tools(json.dumps(tools), "tools")
        except ValueError as exc:
            raise invalid("tools", str(exc)) from None
        try:
            chat = chat_messages(body)
            ids = chat_ids(tokenizer, chat, tools, "messages", kwargs, template, content_format, continues(body, chat))
        except ValueError as exc:
            raise invalid("chat_template" if template is not None else "messages", str(exc)) from None
    strings = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids), "token_strs": strings}


def chat_prompt_length(tokenizer, inputs: dict, content_format: str = "auto") -> int:
    """How many tokens a chat request's ensemble inputs (protocol.parse_chat's, one choice) make: the server's
    preprocessing renders them the same way (its checks, its chat template over the messages and the tools,
    the template's variables). ValueError where the server would refuse them."""
    def given(name: str) -> str | None:
        return inputs[name].reshape(-1)[0].decode("utf-8") if name in inputs else None

    tools, kwargs = given(tn.TOOLS), given(tn.CHAT_TEMPLATE_KWARGS)
    return len(chat_ids(tokenizer, server_messages(given(tn.MESSAGES), tn.MESSAGES),
                        None if tools is None else chat_tools(tools, tn.TOOLS), tn.MESSAGES,
                        None if kwargs is None else chat_template_kwargs(kwargs, tn.CHAT_TEMPLATE_KWARGS),
                        given(tn.CHAT_TEMPLATE), content_format,
                        bool(inputs[tn.CONTINUE_FINAL_MESSAGE].reshape(-1)[0]) if tn.CONTINUE_FINAL_MESSAGE in inputs
                        else False))


def requested_max_tokens(inputs: dict, default: int) -> int:
    """The max_tokens a choice's inputs ask for (`default`: the server's, when they do not say)."""
    settings = json.loads(inputs[tn.SAMPLING_PARAMETERS].reshape(-1)[0].decode("utf-8"))
    value = settings.get("max_tokens")
    return default if value is None else value


def detokenize(tokenizer, body: dict) -> dict:
    """`{"tokens": [ids]}` -> `{"prompt": text}` (special tokens kept, as vLLM decodes them)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    ids = body.get("tokens")
    size = len(tokenizer)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < size
                                            for t in ids):
        raise invalid("tokens", f"must be a list of token ids within [0, {size})")
    return {"prompt": tokenizer.decode(ids)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """The tokenizer's class, special tokens, chat template and the model's context length."""
    info = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len or None,
            "chat_template": getattr(tokenizer, "chat_template", None)}
    for name in SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) else None
    return info
