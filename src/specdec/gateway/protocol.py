"""The OpenAI API's requests and responses, and their mapping onto the ensemble's inputs: pure functions, no
network. A request is checked for what is OpenAI's own (the chat, `n`, tools, `response_format`,
`logprobs`, stream options); its sampling settings travel as vLLM's `sampling_parameters` JSON, which the
server already parses, so every range and combination is checked in one place (the server), and its
refusals name the field. A request of several choices (`n`, a completions request's list of prompts)
becomes one generation of the ensemble per choice, in the order of their `index`; tools and tool choices
become the ensemble's `tools` input and, where a call is forced, its structured output (tools.py). Objects
follow openai-python's types (`ChatCompletion`, `ChatCompletionChunk`, `Completion`), field by field.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specdec import tensor_names as tn
from specdec.decoding.text import request_template as checked_template
from specdec.engine.lora_config import directory_adapter, directory_adapters
from specdec.gateway import reasoning
from specdec.gateway import tools as tool_calls
from specdec.gateway.tools import NAMED, REQUIRED, ToolCalling

# Fields a client may send that change nothing here (bookkeeping of OpenAI's platform; prompt caching is automatic
# here, usage's cached_tokens says what it held).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                  "prompt_cache_options", "safety_identifier")
# OpenAI's and vLLM's sampling settings that are keys of the server's `sampling_parameters` under the same name.
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                   # vLLM's extras, as its OpenAI server takes them
                   "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                   "spaces_between_special_tokens", "truncate_prompt_tokens", "structured_outputs",
                   # this server's (SGLang's name): a streamed answer's chunks at least this many tokens apart
                   "stream_interval")
# vLLM's older structured-output fields -> the key of its `structured_outputs` object they stand for
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# ... and their options (vLLM's older names): the JSON's whitespace; the backend (this server has one)
GUIDED_OPTIONS = {"guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": "backend"}
# This server's own: the speculative settings of a request, as extension fields.
SPECULATIVE_FIELDS = {"num_draft_tokens": (tn.NUM_DRAFT_TOKENS, np.int32), "adaptive_draft": (tn.ADAPTIVE_DRAFT, np.bool_),
                      "num_draft_branches": (tn.NUM_DRAFT_BRANCHES, np.int32), "draft_model": (tn.DRAFT_MODEL, np.object_)}
# vLLM's `priority`: a request's place among those waiting while the server is full (lower first).
SCHEDULING_FIELDS = {"priority": (tn.PRIORITY, np.int32)}
# vLLM's beam-search settings and its tokenizing flag, which clients written for vLLM send at their defaults: taken
# where they ask for nothing (`_vllm_defaults`)
VLLM_DEFAULT_FIELDS = ("use_beam_search", "length_penalty", "early_stopping", "add_special_tokens")
COMMON_FIELDS = ("model", "stream", "stream_options", "n", "best_of", "logit_bias", "logprobs", "prompt_logprobs",
                 "max_tokens", "return_token_ids", *VLLM_DEFAULT_FIELDS,
                 "return_tokens_as_token_ids", "request_id", "cache_salt",
                 *SAMPLING_FIELDS, *GUIDED_FIELDS, *GUIDED_OPTIONS, *SPECULATIVE_FIELDS, *SCHEDULING_FIELDS,
                 *IGNORED_FIELDS)
INT32 = (-2**31, 2**31 - 1)
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
               "tool_choice", "parallel_tool_calls", "functions", "function_call", "chat_template_kwargs", "chat_template",
               "include_reasoning", "reasoning_effort", "thinking_token_budget", "prediction", "continue_final_message",
               "add_generation_prompt", "documents", "modalities", "echo", "verbosity")
# OpenAI's reasoning efforts (its SDK's ReasoningEffort): handed to the chat template as `reasoning_effort`, the
# variable the templates that take one read (gpt-oss's); the others leave it unused
THINKING_FIELDS = (tn.REASONING_CONTENT, "reasoning")  # an assistant message's thinking: vLLM's two names
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# OpenAI's `verbosity` (the Responses API's `text.verbosity`): its default, which asks nothing of a model; the
# models served here have no such control, so another value is refused rather than dropped
DEFAULT_VERBOSITY = "medium"
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "echo", "suffix", "response_format")  # (vLLM's too)
OPENAI_TEMPERATURE = 1.0  # OpenAI's default: a request that sets no temperature samples
# What a request that leaves them out gets: OpenAI's, unless the model's generation config says more (the API's
# --generation-config, generation_config.sampling_defaults merged over these)
DEFAULT_SAMPLING = {"temperature": OPENAI_TEMPERATURE}
MAX_CHOICES = 128  # OpenAI's bound on `n`; here also on n x prompts (each choice is a sequence of the server's)
STATS = (tn.NUM_ROUNDS, tn.TOTAL_DRAFT_TOKENS, tn.TOTAL_ACCEPTED_DRAFT_TOKENS, tn.ACCEPTANCE_RATE,
         tn.MEAN_ACCEPTED_LENGTH)
STATS_FIELD = "speculative_decoding"  # the response's extension object holding STATS


class ApiError(Exception):
    """An answer in OpenAI's error form: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 503: "service_unavailable", 429: "rate_limit_error"}.get(self.status,
                                                                                                  "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID = 256  # characters: an id goes into logs, Triton's request and a response header


def request_id(header: str | None, body: dict) -> str | None:
    """vLLM's: a request's id from its X-Request-Id header, else its body's `request_id` (None: neither); the
    answer's id is it, prefixed (chatcmpl-, cmpl-), and Triton's requests carry it (its logs and traces)."""
    for param, value in ((REQUEST_ID_HEADER, header), ("request_id", body.get("request_id"))):
        if value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID or not value.isprintable():
            raise invalid(param, f"must be 1 to {MAX_REQUEST_ID} printable characters, got {json.dumps(value)[:80]}")
        return value
    return None


@dataclass
class Generation:
    """One OpenAI request, mapped: the ensemble's inputs and how to answer."""

    chat: bool
    model: str
    # The ensemble's inputs of each choice, by index: a completions request's prompts in order, each
    # prompt's n choices together (index = prompt * n + j, as OpenAI numbers them)
    choices: list[dict[str, np.ndarray]]
    n: int = 1  # choices per prompt
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM): usage on every chunk
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely tokens at each position, this many
    # vLLM's return_tokens_as_token_ids: log-probabilities name their tokens "token_id:N" (a token whose text
    # alone is not a character, or that several tokens share, still named exactly)
    tokens_as_ids: bool = False
    # vLLM's prompt_logprobs k: the answer lists, for each prompt token after the first, its log-probability
    # and rank and its position's k most likely tokens (a chat's once, a completion's per choice); None: not
    prompt_logprobs: int | None = None
    tools: ToolCalling | None = None  # how the answer becomes tool calls (tools.py); None: text only
    reasoning: str | None = None  # reasoning.PARSERS: a chat's thinking apart from its content; None: not split
    include_reasoning: bool = True  # vLLM's include_reasoning: false leaves the thinking out of the answer
    # completions' echo: each choice's text (and log-probabilities) start with its prompt's: the prompts as
    # sent, per choice (a string, or token ids the gateway decodes)
    echo: list[str | list[int]] | None = None
    # vLLM's chat echo: the chat's last message, the assistant's, leads each choice's content ("" for none)
    chat_echo: str = ""
    score_only: bool = False  # echo with max_tokens 0: the prompt's scores, nothing generated (one is, unsent)
    sampling: dict = field(default_factory=dict)  # the sampling settings sent, defaults included (the echoes')
    # The request's field its guide (structured output) came from, named in the server's refusal of the guide
    guide_field: str = "response_format"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def return_token_ids(self) -> bool:
        """vLLM's return_token_ids: the answer also holds the prompt's and the generated tokens' ids."""
        return tn.RETURN_PROMPT_IDS in self.choices[0]

    @property
    def server_top(self) -> int:
        return server_top(self.top_logprobs, self.prompt_logprobs)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id


def _string(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)


def check_verbosity(value, name: str) -> None:
    """OpenAI's verbosity: absent or its default (`DEFAULT_VERBOSITY`), else refused naming `name`."""
    if value not in (None, DEFAULT_VERBOSITY):
        raise invalid(name, f"only {json.dumps(DEFAULT_VERBOSITY)} (OpenAI's default) is served: the models here have "
                            f"no verbosity setting, got {json.dumps(value)[:40]}")


def _check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise invalid(unknown[0], "unrecognized request argument (not supported by this server)")


def _typed(body: dict, name: str, kinds: tuple[type, ...], what: str):
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise invalid(name, f"must be {what}, got {json.dumps(value)[:80]}")
    return value


class Served(tuple):
    """The names clients send as `model`: the server's model's (the first is the default), then its LoRA
    adapters' (vLLM's: an adapter is a model of its own name, whose requests carry it as lora_name), and
    those of the directory of adapters the target reads on demand, as it holds them now (`listed`)."""

    adapters: frozenset[str]
    directory: str

    def __new__(cls, names, adapters=(), directory: str = ""):
        self = super().__new__(cls, tuple(names) + tuple(name for name in adapters if name not in names))
        self.adapters = frozenset(adapters) - set(names)
        self.directory = directory
        return self

    def __contains__(self, model) -> bool:
        return super().__contains__(model) or self.is_adapter(model)

    def is_adapter(self, model: str) -> bool:
        """Whether `model` names a LoRA adapter's model."""
        return model in self.adapters or (not super().__contains__(model)
                                          and directory_adapter(self.directory, model) is not None)

    def listed(self) -> tuple[str, ...]:
        """Every name, the directory's adapters' as they are now included."""
        names = tuple(self)
        return names + tuple(name for name in directory_adapters(self.directory) if name not in names)


def is_adapter(served: tuple[str, ...], model: str) -> bool:
    """Whether `model` names a LoRA adapter's model (a plain tuple of names has none)."""
    return isinstance(served, Served) and served.is_adapter(model)


def _adapter(inputs: dict, model: str, served: tuple[str, ...]) -> None:
    """A request for an adapter's model runs that adapter."""
    if is_adapter(served, model):
        inputs[tn.LORA_NAME] = _string(model)


def _model(body: dict, served: tuple[str, ...]) -> str:
    model = _typed(body, "model", (str,), "a string")
    if model is None:
        return served[0]
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist (served: {', '.join(served)})", param="model",
                       code="model_not_found")
    return model


def _choices_per_prompt(body: dict) -> int:
    n = _typed(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"must be within [1, {MAX_CHOICES}], got {n}")
    return 1 if n is None else n


def _vllm_defaults(body: dict, chat: bool, n: int) -> None:
    """vLLM's fields that clients written for it send at their defaults: taken where they ask for nothing."""
    best_of = _typed(body, "best_of", (int,), "an integer")
    if best_of not in (None, n):
        raise invalid("best_of", f"only n ({n}) is supported: choices are not ranked")
    if _typed(body, "use_beam_search", (bool,), "a boolean"):
        raise invalid("use_beam_search", "beam search is not served: a request decodes greedily or samples")
    # beam search's own: nothing without it, as on vLLM
    _typed(body, "length_penalty", (int, float), "a number")
    if body.get("early_stopping") not in (None, True, False, "never"):
        got = json.dumps(body["early_stopping"])[:80]
        raise invalid("early_stopping", f"must be a boolean or \"never\", got {got}")
    # vLLM's defaults: a chat's template writes the model's special tokens, a text prompt gets the tokenizer's
    special = _typed(body, "add_special_tokens", (bool,), "a boolean")
    if special is not None and special == chat:
        raise invalid("add_special_tokens", f"only {str(not chat).lower()} is served on this endpoint (" + (
            "the chat template writes the model's special tokens" if chat else
            "a text prompt gets its tokenizer's special tokens; send prompt token ids for other ones") + ")")


def _common(body: dict, chat: bool, defaults: dict | None) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(sampling_parameters, other inputs, stream settings) of the fields both endpoints take; `defaults`: the
    sampling fields' values where the body has none (None: OpenAI's, DEFAULT_SAMPLING)."""
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    options = _typed(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    options = options or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise invalid(f"stream_options.{unknown[0]}", "unrecognized (supported: include_usage, continuous_usage_stats)")
    for key in options:
        _typed(options, key, (bool,), "a boolean")
    settings = {"include_usage": bool(options.get("include_usage")),
                "continuous_usage": bool(options.get("continuous_usage_stats"))}

    # null and [] are unset (clients send `stop: []`, LangChain `stop: null`)
    sampling = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) not in (None, [])}
    for name, value in (DEFAULT_SAMPLING if defaults is None else defaults).items():
        sampling.setdefault(name, value)
    limits = [(name, _typed(body, name, (int,), "an integer")) for name in ("max_completion_tokens", "max_tokens")
              if body.get(name) is not None]
    if len({value for _, value in limits}) > 1:
        raise invalid("max_completion_tokens", "and max_tokens differ; send one")
    if limits:
        sampling["max_tokens"] = limits[0][1]
    elif "max_tokens" not in sampling:  # OpenAI's: an answer runs until it ends or the context is full (up to
        # the server's max_max_tokens), not the Triton API's default_max_tokens
        sampling[tn.MAX_TOKENS_TO_CONTEXT] = True
    bias = _typed(body, "logit_bias", (dict,), "an object of token ids to biases")
    if bias:
        sampling["logit_bias"] = bias  # token ids as JSON keys (strings); the server checks ids and ranges
    guided = {GUIDED_FIELDS[name]: body[name] for name in GUIDED_FIELDS if body.get(name) is not None}
    if guided:
        if "structured_outputs" in sampling or len(guided) > 1:
            raise invalid(next(iter(n for n in GUIDED_FIELDS if body.get(n) is not None)),
                          "give one structured-output setting")
        sampling["structured_outputs"] = guided
        guided.update({GUIDED_OPTIONS[name]: body[name] for name in GUIDED_OPTIONS if body.get(name) is not None})
    elif body.get("guided_whitespace_pattern") is not None:
        raise invalid("guided_whitespace_pattern", "applies to guided_json's JSON: send guided_json with it")
    inputs = {}
    if _typed(body, "return_token_ids", (bool,), "a boolean"):  # (the generated ones come with every answer)
        inputs[tn.RETURN_PROMPT_IDS] = np.array([[True]], dtype=np.bool_)
    salt = _typed(body, "cache_salt", (str,), "a string")
    if salt is not None:  # (its length the server checks)
        if not salt:
            raise invalid("cache_salt", "must not be empty (leave it out for the shared cache)")
        inputs[tn.CACHE_SALT] = _string(salt)
    for name, (tensor, dtype) in {**SPECULATIVE_FIELDS, **SCHEDULING_FIELDS}.items():
        value = body.get(name)
        if value is None:
            continue
        if dtype is np.object_:
            inputs[tensor] = _string(_typed(body, name, (str,), "a string"))
        elif dtype is np.bool_:
            inputs[tensor] = np.array([[_typed(body, name, (bool,), "a boolean")]], dtype=np.bool_)
        else:
            value = _typed(body, name, (int,), "an integer")
            if not INT32[0] <= value <= INT32[1]:  # numpy would overflow: an error of ours, not a 500
                raise invalid(name, f"must be within [{INT32[0]}, {INT32[1]}], got {value}")
            inputs[tensor] = np.array([[value]], dtype=dtype)
    return sampling, inputs, {"stream": stream, **settings}


def server_top(top: int, prompt_k: int | None) -> int:
    """The most likely tokens the server sends at each position: as many as the generated tokens' `top_logprobs`
    or the prompt's `prompt_logprobs` ask, the larger (each list is cut to its own count); they come with
    return_log_probs, which the request's inputs then carry whether or not its answer shows log-probabilities."""
    return max(top, prompt_k or 0)


def _prompt_logprobs(body: dict, inputs: dict[str, np.ndarray], stream: bool) -> int | None:
    """vLLM's prompt_logprobs k (None: not asked for; ApiError naming it): the server scores the prompt."""
    k = _typed(body, "prompt_logprobs", (int,), "an integer")
    if k is None:
        return None
    if not 0 <= k <= tn.MAX_TOP_LOG_PROBS:
        raise invalid("prompt_logprobs", f"must be within [0, {tn.MAX_TOP_LOG_PROBS}], got {k}")
    if stream:  # (as vLLM: a streamed answer has no place for them)
        raise invalid("prompt_logprobs", "is not available when stream is true")
    inputs[tn.RETURN_PROMPT_LOG_PROBS] = np.array([[True]], dtype=np.bool_)
    return k


# An answer sent whole is streamed by the server too, gathered here, a response at most every this many
# milliseconds: through the ensemble a client's cancel reaches a running generation only by a streamed
# response's postprocessing step (docs/api.md, Cancellation), so an answer whose client went away (a timeout)
# stops within this interval and a round instead of running to max_tokens, while paying that step a few times
# a second rather than every round.
WHOLE_ANSWER_STREAM_INTERVAL_MS = 100


def _finish(sampling: dict, inputs: dict[str, np.ndarray], stream: bool, logprobs: bool, n: int = 1, top: int = 0
            ) -> list[dict[str, np.ndarray]]:
    """The ensemble's inputs of a prompt's n choices. A seeded request's choice j samples with seed + j:
    reproducible as a whole, and its choices differ from each other (one seed would repeat one answer)."""
    if not stream:
        sampling = {**sampling, "stream_interval_ms": WHOLE_ANSWER_STREAM_INTERVAL_MS}
    out = []
    for j in range(n):
        settings = sampling
        seed = sampling.get("seed")
        if j and isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
            settings = {**sampling, "seed": (seed + j) % 2**64}
        choice = dict(inputs)
        choice[tn.SAMPLING_PARAMETERS] = _string(json.dumps(settings))
        choice[tn.STREAM] = np.array([[True]], dtype=np.bool_)  # an answer sent whole too: see below
        if logprobs:
            choice[tn.RETURN_LOG_PROBS] = np.array([[True]], dtype=np.bool_)
        if top:
            choice[tn.NUM_TOP_LOG_PROBS] = np.array([[top]], dtype=np.int32)
        out.append(choice)
    return out


def joined_text(content, where: str, kinds: tuple[str, ...], parts: str,
                part_name: Callable[[int], str] | None = None) -> str:
    """A message's content as one text: a string, or a list of parts of these kinds whose `text` is a string
    (ApiError naming `where`, or the part: part_name(j), by default `where[j]`). `parts` names them in errors.
    The chat's, the Responses API's and Anthropic's content alike."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            name = part_name(j) if part_name else f"{where}[{j}]"
            if not isinstance(part, dict) or part.get("type") not in kinds:
                raise invalid(name, f"only {parts} are supported")
            if not isinstance(part.get("text"), str):  # (a text part: its text is what is wrong)
                raise invalid(f"{name}.text", "must be a string")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, f"must be a string or a list of {parts}")


def _content(message: dict, i: int) -> str:
    return joined_text(message.get("content"), f"messages[{i}].content", ("text",),
                       'text parts ({"type": "text", "text": ...})')


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as the server's `messages` input takes them (text content; developer
    messages as system ones, which every chat template knows)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "is required: a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise invalid(f"messages[{i}].role", f"must be system, developer, user, assistant or tool, got "
                          f"{json.dumps(role)}" + (" (send tools and tool messages)" if role == "function" else ""))
        # an answer sent back keeps its thinking (vLLM's reasoning_content, or reasoning): the chat template
        # decides what of it the prompt shows (Qwen3's, gpt-oss's: that of the turn still calling tools)
        own = {"role", "content", "name"} | ({"tool_calls", *THINKING_FIELDS} if role == "assistant" else set()) | (
            {"tool_call_id"} if role == "tool" else set())
        extra = sorted(set(message) - own)
        if extra and not all(message[key] in (None, [], "") for key in extra):
            raise invalid(f"messages[{i}].{extra[0]}", "is not supported (audio and refusals are not)")
        calls = message.get("tool_calls") if role == "assistant" else None
        content = "" if calls and message.get("content") is None else _content(message, i)
        entry = {"role": "system" if role == "developer" else role, "content": content}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if calls:
            entry["tool_calls"] = _message_calls(calls, i)
        thinking = [(key, message[key]) for key in THINKING_FIELDS if message.get(key) not in (None, "")]
        if role == "assistant" and thinking:
            key, value = thinking[0]
            if not isinstance(value, str):
                raise invalid(f"messages[{i}].{key}", "must be a string (the answer's thinking)")
            entry[tn.REASONING_CONTENT] = value
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise invalid(f"messages[{i}].tool_call_id", "is required in a tool message (the call it answers)")
            entry["tool_call_id"] = message["tool_call_id"]
        out.append(entry)
    return out


def _message_calls(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls", "must be a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), str)):
            raise invalid(f"messages[{i}].tool_calls[{j}]",
                          "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\": a JSON string}}")
    return calls


def chat_tools(body: dict, sampling: dict, parser: str | None) -> tuple[list[dict] | None, ToolCalling | None]:
    """The request's tools (checked) and how its answer becomes calls, by `tool_choice` (tools.py); a
    named function or "required" constrain the output, set here as its structured output."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return None, None
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise invalid(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}")
        name = function.get("name")
        if not isinstance(name, str) or not tool_calls.FUNCTION_NAME.fullmatch(name):
            raise invalid(f"tools[{i}].function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise invalid(f"tools[{i}].function.name", f"{name} is given twice")
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"tools[{i}].function.parameters", "must be a JSON schema object")
        if function.get("strict") not in (None, True, False):
            raise invalid(f"tools[{i}].function.strict", "must be a boolean")
        names.append(name)
    parallel = _typed(body, "parallel_tool_calls", (bool,), "a boolean") is not False
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise invalid("tool_choice", f"names no tool of this request ({json.dumps(choice)[:80]})")
        calling = ToolCalling(NAMED, (name,), parallel=False)
    elif choice == "none":
        return tools, None
    elif choice == "required":
        calling = ToolCalling(REQUIRED, tuple(names), parallel=parallel)
    elif choice == "auto":
        if parser is None:
            raise invalid("tool_choice", "auto needs the API started with a tool-call parser (--tool-call-parser "
                                         f"{' or '.join(tool_calls.PARSERS)}, as the model writes its calls); send "
                                         "\"required\", a named function or \"none\"")
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in tools}
        tags = tool_calls.strict_call_tags(tools, parser)
        if tags is not None and "structured_outputs" not in sampling:  # (a guide of the request's own wins)
            sampling["structured_outputs"] = {"structural_tag": tags}
        return tools, ToolCalling(tool_calls.AUTO, tuple(names), parser, parallel, schemas)
    else:
        raise invalid("tool_choice", f"must be none, auto, required or {{\"type\": \"function\", ...}}, got "
                                     f"{json.dumps(choice)[:80]}")
    if "structured_outputs" in sampling:
        raise invalid("tool_choice", "and response_format or structured_outputs both constrain the output; send one")
    # compact: whitespace between JSON tokens is no part of a call, and a model may run on in it
    sampling["structured_outputs"] = {"json": tool_calls.forced_schema(tools, calling), "disable_any_whitespace": True}
    return tools, calling


def response_format(body: dict, sampling: dict) -> None:
    """A body's `response_format` as its sampling's `structured_outputs` (chat, and vLLM's completions too)."""
    fmt = _typed(body, "response_format", (dict,), "an object")
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind == "json_object":
        guide = {"json_object": True}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format.json_schema", "must be an object with a 'schema' object")
        guide = {"json": spec.get("schema", {})}
    elif kind == "structural_tag":  # vLLM's and SGLang's: {structures: [{begin, schema, end}], triggers}
        guide = {"structural_tag": fmt}
    elif kind == "text":
        return
    else:
        raise invalid("response_format.type", "must be text, json_object, json_schema or structural_tag, got "
                                              f"{json.dumps(kind)}")
    if "structured_outputs" in sampling:
        raise invalid("response_format", "and structured_outputs both constrain the output; send one")
    sampling["structured_outputs"] = guide


def parse_chat(body: dict, served: tuple[str, ...], tool_parser: str | None = None,
               reasoning_parser: str | None = None, trust_template: bool = False,
               defaults: dict | None = None) -> Generation:
    """A /v1/chat/completions body -> the ensemble's inputs (ApiError naming the field otherwise).
    trust_template: a request's own `chat_template` is passed on (vLLM's --trust-request-chat-template), else
    refused. defaults: the sampling fields' values where the body has none (None: DEFAULT_SAMPLING)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    model = _model(body, served)
    configured, reasoning_parser = reasoning_parser, reasoning.for_request(reasoning_parser,
                                                                          body.get("chat_template_kwargs"))
    for name in ("functions", "function_call"):  # the API's older form
        if body.get(name) not in (None, "none", []):
            raise invalid(name, "is not supported: send tools and tool_choice")
    if body.get("modalities") not in (None, ["text"]):  # OpenAI's default; audio is not generated here
        raise invalid("modalities", f"only [\"text\"] is supported, got {json.dumps(body['modalities'])[:80]}")
    check_verbosity(body.get("verbosity"), "verbosity")
    n = _choices_per_prompt(body)
    _vllm_defaults(body, True, n)
    sampling, inputs, stream = _common(body, True, defaults)
    logprobs = bool(_typed(body, "logprobs", (bool,), "a boolean"))
    top = _typed(body, "top_logprobs", (int,), "an integer") or 0
    if not 0 <= top <= tn.MAX_TOP_LOG_PROBS:
        raise invalid("top_logprobs", f"must be within [0, {tn.MAX_TOP_LOG_PROBS}], got {top}")
    if top and not logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    response_format(body, sampling)
    guided = "structured_outputs" in sampling
    tools, calling = chat_tools(body, sampling, tool_parser)
    budget = _typed(body, "thinking_token_budget", (int,), "an integer")
    if budget is not None:  # vLLM's: the thinking closed after at most this many tokens
        if not reasoning_parser:
            raise invalid("thinking_token_budget", "needs the server to know where the model's thinking ends: " + (
                "it was started without --reasoning-parser" if not configured else
                f"with --reasoning-parser {configured} a request thinks where its chat_template_kwargs say thinking"))
        if not 0 <= budget <= INT32[1]:
            raise invalid("thinking_token_budget", f"must be >= 0 (tokens), got {budget}")
        inputs[tn.THINKING_TOKEN_BUDGET] = np.array([[budget]], dtype=np.int32)
    # (the guide: the answer's, after the thinking; gpt-oss's: its final channel's message)
    if reasoning_parser and ("structured_outputs" in sampling or budget is not None):
        inputs[tn.REASONING_PARSER] = _string(reasoning_parser)
    chat = chat_messages(body)
    echoed = chat[-1]["content"] if _typed(body, "echo", (bool,), "a boolean") and chat[-1]["role"] == "assistant" \
        else ""  # (vLLM's: the last message where it is the answer's role)
    if continues(body, chat):  # vLLM's continue_final_message: the assistant's last message, continued
        inputs[tn.CONTINUE_FINAL_MESSAGE] = np.array([[True]], dtype=np.bool_)
    if tool_parser == "mistral":  # its templates refuse ids but its own form, whoever made them
        chat = tool_calls.mistral_messages(chat)
    if calling is not None and calling.mode == tool_calls.AUTO and calling.parser in tool_calls.SPECIAL_TOKEN_PARSERS \
            or reasoning_parser == tool_calls.HARMONY_REASONING:
        # its calls open with a special token (vLLM does the same); gpt-oss's channels are special tokens
        sampling["skip_special_tokens"] = False
    prediction = _prediction(body)
    if prediction:
        sampling[tn.PREDICTION] = prediction
    inputs[tn.MESSAGES] = _string(json.dumps(chat))
    if tools:
        inputs[tn.TOOLS] = _string(json.dumps(tools))
    template_kwargs = _typed(body, "chat_template_kwargs", (dict,), "an object of the chat template's variables")
    effort = _typed(body, "reasoning_effort", (str,), "a string")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {json.dumps(effort)[:40]}")
        template_kwargs = {"reasoning_effort": effort, **(template_kwargs or {})}  # the explicit variable wins
    template_kwargs = with_documents(body, template_kwargs)
    if template_kwargs:  # the server refuses the names it sets itself, named as this field
        inputs[tn.CHAT_TEMPLATE_KWARGS] = _string(json.dumps(template_kwargs))
    template = request_template(body, trust_template)
    if template is not None:
        inputs[tn.CHAT_TEMPLATE] = _string(template)
    _adapter(inputs, model, served)
    scored = _prompt_logprobs(body, inputs, stream["stream"])
    rows = server_top(top, scored)
    return Generation(chat=True, model=model,
                      choices=_finish(sampling, inputs, stream["stream"], logprobs or rows > 0, n, rows),
                      n=n, stream=stream["stream"], include_usage=stream["include_usage"],
                      continuous_usage=stream["continuous_usage"], logprobs=logprobs, top_logprobs=top,
                      tokens_as_ids=_tokens_as_ids(body), prompt_logprobs=scored, tools=calling,
                      reasoning=reasoning_parser, include_reasoning=_typed(body, "include_reasoning", (bool,),
                                                                           "a boolean") is not False,
                      sampling=sampling, chat_echo=echoed,
                      guide_field=guide_field(body, tools_guided=not guided and "structured_outputs" in sampling))


def with_documents(body: dict, template_kwargs: dict | None) -> dict | None:
    """The chat template's variables with vLLM's `documents` (a RAG template's sources, the template call's
    `documents`: a list of objects of strings; ApiError naming it) among them; chat_template_kwargs' own
    `documents` wins, as in vLLM."""
    documents = _typed(body, "documents", (list,), "a list of documents (objects of strings)")
    if documents is None:
        return template_kwargs
    for i, document in enumerate(documents):
        if not isinstance(document, dict) or not all(isinstance(v, str) for v in document.values()):
            raise invalid(f"documents[{i}]", "must be an object of strings (e.g. its 'title' and 'text')")
    return {"documents": documents, **(template_kwargs or {})}


def continues(body: dict, chat: list[dict]) -> bool:
    """vLLM's continue_final_message (with add_generation_prompt false, the only way it takes it): whether the
    chat's last message, the assistant's, is continued rather than answered. add_generation_prompt false alone
    (a turn closed and none opened) is refused: nothing here generates from there."""
    continued = _typed(body, "continue_final_message", (bool,), "a boolean") is True
    opened = _typed(body, "add_generation_prompt", (bool,), "a boolean")
    if continued and opened:
        raise invalid("add_generation_prompt", "and continue_final_message cannot both be true: the last message "
                                               "is continued, no turn opened")
    if opened is False and not continued:
        raise invalid("add_generation_prompt", "false is taken with continue_final_message true (the assistant's "
                                               "last message continued)")
    if continued and chat[-1]["role"] != "assistant":
        raise invalid("continue_final_message", "continues the assistant's last message: the chat's last message "
                                                "must be the assistant's")
    return continued


def _prediction(body: dict) -> str:
    """OpenAI's Predicted Outputs: `prediction` {"type": "content", "content": text or text parts}, the answer
    the request expects, which the server drafts from ("" for none)."""
    prediction = _typed(body, "prediction", (dict,), 'an object {"type": "content", "content": ...}')
    if prediction is None:
        return ""
    if prediction.get("type") != "content":
        raise invalid("prediction.type", f"must be content, got {json.dumps(prediction.get('type'))}")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise invalid("prediction.content", "must be a string or a list of text parts")


def request_template(body: dict, trusted: bool) -> str | None:
    """A request's own `chat_template` (vLLM's field), checked; refused unless the API trusts requests' templates
    (as vLLM refuses it without --trust-request-chat-template)."""
    template = _typed(body, "chat_template", (str,), "a string: a Jinja chat template")
    if template is None:
        return None
    if not trusted:
        raise invalid("chat_template", "a request's own chat template is not taken here (a template is code the "
                                       "server runs): the server was started without --trust-request-chat-template")
    try:
        return checked_template(template, "chat_template")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="chat_template") from None


def _prompts(prompt) -> list[str | list[int]]:
    """A completions request's prompts, as OpenAI takes them: a string, a list of strings, a list of token
    ids, or a list of such lists."""
    def ids(value) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value)
    if isinstance(prompt, str):
        return [prompt]
    if ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(ids(p) for p in prompt)):
        return prompt
    raise invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists")


def _tokens_as_ids(body: dict) -> bool:
    return bool(_typed(body, "return_tokens_as_token_ids", (bool,), "a boolean"))


def parse_completion(body: dict, served: tuple[str, ...], defaults: dict | None = None) -> Generation:
    """A /v1/completions body -> the ensemble's inputs (ApiError naming the field otherwise); defaults as
    parse_chat's."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    model = _model(body, served)
    prompts = _prompts(body.get("prompt"))
    echo = bool(_typed(body, "echo", (bool,), "a boolean"))
    if body.get("suffix") not in (None, ""):
        raise invalid("suffix", "is not supported")
    n = _choices_per_prompt(body)
    _vllm_defaults(body, False, n)
    if n * len(prompts) > MAX_CHOICES:
        raise invalid("n", f"n x the prompts ({n} x {len(prompts)}) exceeds {MAX_CHOICES} choices")
    sampling, inputs, stream = _common(body, False, defaults)
    response_format(body, sampling)
    count = _typed(body, "logprobs", (int,), "an integer")
    if count is not None and not 0 <= count <= tn.MAX_TOP_LOG_PROBS:
        raise invalid("logprobs", f"must be within [0, {tn.MAX_TOP_LOG_PROBS}], got {count}")
    logprobs, top = count is not None, count or 0
    # echo with max_tokens 0 (what scoring clients send): the server generates one token, never sent
    score_only = echo and sampling.get("max_tokens") == 0
    if score_only:
        sampling["max_tokens"] = 1
    if echo and logprobs:  # the prompt's own log-probabilities, from the server
        inputs[tn.RETURN_PROMPT_LOG_PROBS] = np.array([[True]], dtype=np.bool_)
    scored = _prompt_logprobs(body, inputs, stream["stream"])
    if scored is None and echo and logprobs and not stream["stream"]:  # vLLM's answer lists them then too
        scored = top
    rows = server_top(top, scored)
    _adapter(inputs, model, served)
    choices = []
    for prompt in prompts:
        # A completion continues the text as it is: no chat template (the server's default may apply one)
        given = {tn.TEXT_INPUT: _string(prompt), tn.APPLY_CHAT_TEMPLATE: np.array([[False]], dtype=np.bool_)} \
            if isinstance(prompt, str) else {tn.PROMPT_TOKEN_IDS: np.array([prompt], dtype=np.int32)}
        choices += _finish(sampling, {**inputs, **given}, stream["stream"], logprobs or rows > 0, n, rows)
    return Generation(chat=False, model=model, choices=choices, n=n,
                      stream=stream["stream"], include_usage=stream["include_usage"],
                      continuous_usage=stream["continuous_usage"], logprobs=logprobs, top_logprobs=top,
                      tokens_as_ids=_tokens_as_ids(body), prompt_logprobs=scored,
                      echo=[prompt for prompt in prompts for _ in range(n)] if echo else None, score_only=score_only,
                      sampling=sampling, guide_field=guide_field(body))


# ---- errors of the server, as OpenAI errors ----------------------------------------------------------------
_KEY = re.compile(rf"input '{tn.SAMPLING_PARAMETERS}': key '([a-z_]+)'")
_INPUT = re.compile(r"input '([a-z_]+)'")
# What the server's refusals say before the input they are about: the ensemble, Triton's request id, a model
_WHERE = re.compile(r"(in ensemble '[^']*', |\[request id: [^\]]*\] |[a-z_]+: )*")
_INPUT_FIELDS = {tn.STOP_WORDS: "stop", tn.MESSAGES: "messages", tn.TEXT_INPUT: "prompt", tn.PROMPT_TOKEN_IDS: "prompt",
                 tn.TOOLS: "tools",
                 tn.GUIDED_DECODING_GUIDE: "response_format", tn.NUM_DRAFT_TOKENS: "num_draft_tokens",
                 tn.NUM_DRAFT_BRANCHES: "num_draft_branches", tn.DRAFT_MODEL: "draft_model", tn.MAX_TOKENS: "max_tokens",
                 tn.LORA_NAME: "model"}


def server_error(message: str, unavailable: bool = False) -> ApiError:
    """A refusal of the ensemble as an OpenAI error: capacity and readiness are 503 (retry), a refused
    input 400 naming the request's field it came from, in its param and at the start of its message (the
    server's names of its inputs are not the client's: "input 'sampling_parameters': key 'top_k' must be an
    integer" -> "top_k must be an integer"), anything else 500."""
    lowered = message.lower()
    if tn.RETRY_LATER in lowered or tn.MODEL_DOWN in lowered or unavailable:
        return ApiError(503, message, code="server_busy" if tn.RETRY_LATER in lowered else "unavailable")
    key, name = _KEY.search(message), _INPUT.search(message)
    if key or name:
        param = key.group(1) if key else _INPUT_FIELDS.get(name.group(1), name.group(1))
        found = key or name
        if _WHERE.fullmatch(message[:found.start()]):  # (what the message says first: not reworded otherwise)
            message = param + message[found.end():]
        return ApiError(400, message, param=param)
    if "invalid argument" in lowered or "invalid_arg" in lowered:
        return ApiError(400, message)
    return ApiError(500, message)


def guide_field(body: dict, tools_guided: bool = False) -> str:
    """The field of a request whose value became its guide: `tools` where they did (tools_guided: calls held
    to their schemas), else the first structured-output field the body has."""
    if tools_guided:
        return "tools"
    return next((name for name in (*GUIDED_FIELDS, "structured_outputs") if body.get(name) is not None),
                "response_format")


def guide_error(error: ApiError, field: str) -> ApiError:
    """A refusal of the server's guide (named response_format by `server_error`) named as the request's
    field it came from (`Generation.guide_field`): `tools` for the schemas of its calls, say."""
    if error.param != "response_format" or field == "response_format":
        return error
    return ApiError(error.status, renamed_message(error.message, "response_format", field), field, error.code)


def renamed_message(message: str, old: str, new: str) -> str:
    """A refusal's message that starts with the field `old` (as `invalid` and `server_error` write them),
    starting with `new` instead."""
    return new + message[len(old):] if message.startswith(old) else message


def chat_error(error: ApiError) -> ApiError:
    """A refusal of a chat request: the server names the prompt it rendered from the messages (a prompt too
    long for the context, say) as the prompt; the chat's field for it is `messages`."""
    if error.param != "prompt":
        return error
    return ApiError(error.status, renamed_message(error.message, "prompt", "messages"), "messages", error.code)


# ---- responses -----------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """Chat's and completions' usage; `cached_tokens`: of the prompt's, those the server's prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_counts(stats: dict, received: int) -> tuple[int, int, int]:
    """A choice's (prompt, completion, cached prompt) tokens: the server's counts where it sent them (its last
    response carries them all), else the `received` tokens so far."""
    return (int(stats.get(tn.NUM_INPUT_TOKENS, 0)), max(received, int(stats.get(tn.NUM_OUTPUT_TOKENS, 0))),
            int(stats.get(tn.NUM_CACHED_TOKENS, 0)))


def combined_stats(per_choice: list[dict]) -> dict:
    """The speculation statistics (STATS) of several choices as one answer's: the counts summed, the rates
    recomputed from the sums (acceptance = accepted / drafted, tokens per round = 1 + accepted / rounds), as
    the server computes them for one."""
    if len(per_choice) == 1:
        return {name: per_choice[0][name] for name in STATS if name in per_choice[0]}
    total = {name: sum(stats.get(name, 0) for stats in per_choice)
             for name in (tn.NUM_ROUNDS, tn.TOTAL_DRAFT_TOKENS, tn.TOTAL_ACCEPTED_DRAFT_TOKENS)}
    drafted, accepted, rounds = (total[tn.TOTAL_DRAFT_TOKENS], total[tn.TOTAL_ACCEPTED_DRAFT_TOKENS],
                                 total[tn.NUM_ROUNDS])
    return {**total, tn.ACCEPTANCE_RATE: accepted / drafted if drafted else 0.0,
            tn.MEAN_ACCEPTED_LENGTH: 1.0 + accepted / rounds if rounds else 0.0}


def combined_usage(per_choice: list[dict], completion_tokens: list[int], n: int,
                   reasoning_tokens: list[int] | None = None, predicted: bool = False) -> dict:
    """Usage of an answer of several choices: each prompt's tokens once (its n choices share it, as OpenAI
    counts them), every choice's completion tokens (`token_counts`). `reasoning_tokens`: per choice, those
    of its thinking (with a reasoning parser), in `completion_tokens_details` as OpenAI reports them.
    predicted: the request brought a prediction, whose drafted tokens the target accepted or rejected
    (`accepted_prediction_tokens`, `rejected_prediction_tokens`, as OpenAI reports Predicted Outputs)."""
    counts = [token_counts(stats, received) for stats, received in zip(per_choice, completion_tokens)]
    groups = [counts[i:i + n] for i in range(0, len(counts), n)]
    # a prompt's cached tokens: as many as each of its choices found (each counts the prompt once)
    out = usage(sum(max(c[0] for c in group) for group in groups), sum(c[1] for c in counts),
                sum(min(c[2] for c in group) for group in groups))
    details = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = sum(reasoning_tokens)
    if predicted:
        accepted = sum(int(stats.get(tn.TOTAL_ACCEPTED_DRAFT_TOKENS, 0)) for stats in per_choice)
        drafted = sum(int(stats.get(tn.TOTAL_DRAFT_TOKENS, 0)) for stats in per_choice)
        details.update(accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted)
    if details:
        out["completion_tokens_details"] = details
    return out


def token_id_name(token: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it in log-probabilities."""
    return f"token_id:{token}"


def logprobs_object(chat: bool, tokens: list[str], values: list[float | None], offset: int = 0,
                    top: list[list[tuple[str, float]] | None] | None = None, raw: list[bytes] | None = None,
                    top_raw: list[list[bytes] | None] | None = None, widths: list[int] | None = None) -> dict:
    """The choice's `logprobs`: chat's per-token `content` entries, or the completions API's lists (each
    token's text offset counts from `offset`, the text already sent). `top`: per token its position's most
    likely tokens (text, log-probability), most likely first (chat: a list each; completions: an object of
    texts, as OpenAI's legacy API gives it, so tokens of one text show once). raw, top_raw: chat's `bytes`,
    those the tokens stand for (text.token_bytes; a character split over tokens joins from them), else
    each token's text as UTF-8. widths: the tokens' lengths in the text, where `tokens` names them otherwise
    (return_tokens_as_token_ids), for the completions API's text offsets."""
    if chat:
        def entry(token: str, value: float, data: bytes | None) -> dict:
            return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8") if data is None else data)}
        return {"content": [{**entry(token, value, raw[i] if raw else None),
                             "top_logprobs": [entry(t, v, top_raw[i][j] if top_raw and top_raw[i] else None)
                                              for j, (t, v) in enumerate(top[i] if top else [])]}
                            for i, (token, value) in enumerate(zip(tokens, values))], "refusal": None}
    offsets, at = [], offset
    for i, token in enumerate(tokens):
        offsets.append(at)
        at += widths[i] if widths is not None else len(token)
    # (an echoed prompt's first token has no log-probability, nor a row: None, as OpenAI gives them)
    tops = None if top is None else [None if row is None else _by_text(row) for row in top]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(ids: list[int], values: list[float | None], ranks: list[int | None],
                    top_ids: list[list[int] | None], top_values: list[list[float] | None], k: int,
                    name: Callable[[int], str]) -> list[dict[int, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None for the first (no context), then an object of token ids
    to {logprob, rank, decoded_token}: the token's own first, then its position's k most likely (rank 1 the
    most likely); a token among those listed once, with its own rank. values, ranks, top_*: per token, the
    first None (top_*: [] where no top row came); name: a token's `decoded_token`."""
    out: list[dict[int, dict] | None] = [None] if ids else []
    for i in range(1, len(ids)):
        entry = {ids[i]: {"logprob": values[i], "rank": ranks[i], "decoded_token": name(ids[i])}}
        if k and top_ids:
            for j, (token, value) in enumerate(zip(top_ids[i][:k], top_values[i][:k])):
                entry.setdefault(token, {"logprob": value, "rank": j + 1, "decoded_token": name(token)})
        out.append(entry)
    return out


def _by_text(row: list[tuple[str, float]]) -> dict[str, float]:
    """A position's most likely tokens as the legacy API's object, most likely first; of tokens with one
    text, the likelier."""
    out: dict[str, float] = {}
    for text, value in row:
        out.setdefault(text, value)
    return out


def choice(gen: Generation, text: str | None, finish_reason: str | None, logprobs: dict | None,
           delta: bool, first: bool = False, index: int = 0, tool_calls: list[dict] | None = None,
           reasoning: str | None = None) -> dict:
    """One entry of `choices`: a chat message or delta (with its `tool_calls`, and its thinking, if any), or
    a completion's text."""
    if gen.chat:
        body = {"role": "assistant", "content": text} if (not delta or first) else (
            {} if text is None else {"content": text})
        if reasoning and gen.include_reasoning:
            # SGLang's and DeepSeek's name, and vLLM's current one (it renamed the first): clients read either
            body["reasoning_content"] = body["reasoning"] = reasoning
        if tool_calls:
            body["tool_calls"] = tool_calls
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def add_token_ids(gen: Generation, body: dict, entry: dict, prompt_ids: list[int], ids: list[int], first: bool) -> None:
    """vLLM's return_token_ids on an answer or chunk `body` and its choice `entry`: the choice's generated
    tokens (an echo's prompt first, as its text is); the prompt's with the choice's first, a chat's on the
    body (a chat's first chunk, the role chunk, has them already), a completion's on the choice."""
    entry["token_ids"] = (prompt_ids if gen.echo is not None and first else []) + ids
    if first and not gen.chat:
        entry["prompt_token_ids"] = prompt_ids
    elif first and not gen.stream:
        body["prompt_token_ids"] = prompt_ids


def envelope(gen: Generation, choices: list[dict], chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if gen.chat else "text_completion"
    return {"id": gen.response_id, "object": kind, "created": gen.created, "model": gen.model,
            "system_fingerprint": None, "choices": choices}


# The characters str.splitlines() ends a line at that JSON leaves raw without ensure_ascii (it escapes the
# control characters): a JSON line or event carrying them would come apart in readers that split so (requests'
# iter_lines(decode_unicode=True), a JSONL file read with splitlines()), though it is valid JSON
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_line(value) -> str:
    """Compact JSON with its text as it is (UTF-8 on the wire, not \\u escapes), on one line for every reader:
    the characters str.splitlines() breaks at escaped (the same JSON value)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKERS)


def sse(payload: dict | str) -> bytes:
    """One Server-Sent Event, as OpenAI's SDK reads it."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")
