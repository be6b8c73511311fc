"""Shared pieces of the sync and asyncio clients: typed parameters, the result, errors, timing."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from specdec import tensor_names as tn


class ClientError(Exception):
    """Base class of the client's errors."""


class ServerUnavailableError(ClientError):
    """Nothing answers at the address (server down, wrong port)."""


class ModelNotReadyError(ClientError):
    """The server answers but the model is unknown or not loaded yet."""


class InvalidArgumentError(ClientError):
    """The server refused an input; the message is the server's and names the field."""


class GenerationTimeoutError(ClientError):
    """No complete answer within the timeout."""


class ServerBusyError(ClientError):
    """The server is at capacity (max_live_sequences with when_full=reject, or a model's KV cache full):
    the same request can succeed later. Recognised by its message, which ends "retry later"
    (`tn.RETRY_LATER`): through the ensemble neither a gRPC stream's error nor the HTTP generate endpoint's
    status (400) says UNAVAILABLE."""


@dataclass(frozen=True)
class GenerationParams:
    """Every public input of `ensemble` but the prompt; None = the server's default."""

    max_tokens: int | None = None
    num_draft_tokens: int | None = None  # 0 = target-only decoding; the maximum K when adaptive
    adaptive_draft: bool | None = None  # K adapts per round (the server's default: on)
    # a draft model's candidates per drafted position (1: chains), at most the server's draft_branches
    num_draft_branches: int | None = None
    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None  # keep tokens at least min_p x the most likely one's probability
    seed: int | None = None
    repetition_penalty: float | None = None  # > 0, 1 = off: tokens of prompt and output made less likely
    presence_penalty: float | None = None  # [-2, 2], 0 = off: subtracted from tokens already in the output
    frequency_penalty: float | None = None  # [-2, 2], 0 = off: subtracted per occurrence in the output
    end_id: int | None = None
    min_length: int | None = None  # no end token ends generation before this many tokens
    ignore_eos: bool | None = None  # generate to max_tokens (benchmarks)
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()  # token sequences the output never contains (mid-text words: " word")
    draft_model: str | None = None
    lora_name: str | None = None  # the LoRA adapter the target runs (one the server serves); None: the base model
    cache_salt: str | None = None  # the prompt shares prefix-cache blocks only with requests of this salt
    apply_chat_template: bool | None = None
    return_log_probs: bool | None = None  # each token's log-probability under the target (result.log_probs)
    # with return_log_probs: also each position's n most likely tokens (result.top_ids, result.top_log_probs)
    num_top_log_probs: int | None = None
    # the prompt's tokens and each one's log-probability after the first (result.prompt_ids,
    # result.prompt_log_probs; with num_top_log_probs n their n most likely tokens too): what evaluations score
    return_prompt_log_probs: bool | None = None
    return_prompt_ids: bool | None = None  # the prompt's tokens as the model read them, unscored (result.prompt_ids)
    # TensorRT-LLM's: the target's raw logits at each generated / prompt position (result.generation_logits,
    # result.context_logits): V floats a position
    return_generation_logits: bool | None = None
    return_context_logits: bool | None = None
    # Structured output: json | json_schema | regex | ebnf_grammar | choice, and its schema, pattern, grammar or
    # JSON list of choices (none for json: any JSON object)
    guide_type: str | None = None
    guide: str | None = None
    # deepseek_r1 | qwen3 | openai_gptoss: the guide holds after a reasoning model's thinking (gpt-oss: in its final
    # channel's message), and thinking_token_budget closes the thinking after at most that many tokens
    reasoning_parser: str | None = None
    thinking_token_budget: int | None = None
    priority: int | None = None  # while the server is full, a lower value is admitted first (0 by default)
    # streamed: at most one response per this many milliseconds, the rounds between sent together (None or 0:
    # one per round); what an answer gathered whole but still cancellable asks (docs/api.md, Cancellation)
    stream_interval_ms: int | None = None

    def tensors(self, prompt: str, stream: bool) -> dict[str, np.ndarray]:
        """Input tensors (batch of one) by name."""
        arrays = {tn.TEXT_INPUT: np.array([[prompt.encode("utf-8")]], dtype=np.object_),
                  tn.STREAM: np.array([[stream]], dtype=np.bool_)}
        scalars = [(tn.MAX_TOKENS, self.max_tokens, np.int32), (tn.NUM_DRAFT_TOKENS, self.num_draft_tokens, np.int32),
                   (tn.TEMPERATURE, self.temperature, np.float32), (tn.TOP_K, self.top_k, np.int32),
                   (tn.TOP_P, self.top_p, np.float32), (tn.MIN_P, self.min_p, np.float32),
                   (tn.SEED, self.seed, np.uint64),
                   (tn.REPETITION_PENALTY, self.repetition_penalty, np.float32),
                   (tn.PRESENCE_PENALTY, self.presence_penalty, np.float32),
                   (tn.FREQUENCY_PENALTY, self.frequency_penalty, np.float32),
                   (tn.END_ID, self.end_id, np.int32), (tn.APPLY_CHAT_TEMPLATE, self.apply_chat_template, np.bool_),
                   (tn.ADAPTIVE_DRAFT, self.adaptive_draft, np.bool_),
                   (tn.NUM_DRAFT_BRANCHES, self.num_draft_branches, np.int32), (tn.MIN_LENGTH, self.min_length, np.int32),
                   (tn.IGNORE_EOS, self.ignore_eos, np.bool_), (tn.RETURN_LOG_PROBS, self.return_log_probs, np.bool_),
                   (tn.NUM_TOP_LOG_PROBS, self.num_top_log_probs, np.int32),
                   (tn.RETURN_PROMPT_LOG_PROBS, self.return_prompt_log_probs, np.bool_),
                   (tn.RETURN_PROMPT_IDS, self.return_prompt_ids, np.bool_), (tn.PRIORITY, self.priority, np.int32),
                   (tn.RETURN_GENERATION_LOGITS, self.return_generation_logits, np.bool_),
                   (tn.RETURN_CONTEXT_LOGITS, self.return_context_logits, np.bool_),
                   (tn.THINKING_TOKEN_BUDGET, self.thinking_token_budget, np.int32)]
        for name, value, dtype in scalars:
            if value is not None:
                arrays[name] = np.array([[value]], dtype=dtype)
        for name, value in ((tn.DRAFT_MODEL, self.draft_model), (tn.LORA_NAME, self.lora_name),
                            (tn.CACHE_SALT, self.cache_salt)):
            if value is not None:
                arrays[name] = np.array([[value.encode()]], dtype=np.object_)
        for name, words in ((tn.STOP_WORDS, self.stop_words), (tn.BAD_WORDS, self.bad_words)):
            if words:
                arrays[name] = np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)
        for name, text in ((tn.GUIDED_DECODING_GUIDE_TYPE, self.guide_type), (tn.GUIDED_DECODING_GUIDE, self.guide),
                           (tn.REASONING_PARSER, self.reasoning_parser)):
            if text is not None:
                arrays[name] = np.array([[text.encode("utf-8")]], dtype=np.object_)
        if self.stream_interval_ms is not None:  # a setting of the sampling_parameters JSON (no input of its own)
            settings = json.dumps({"stream_interval_ms": self.stream_interval_ms})
            arrays[tn.SAMPLING_PARAMETERS] = np.array([[settings.encode("utf-8")]], dtype=np.object_)
        return arrays

    def json(self, prompt: str, stream: bool) -> dict:
        """The body of Triton's generate extension (/generate, /generate_stream)."""
        body = {tn.TEXT_INPUT: prompt, tn.STREAM: stream}
        for name in ("max_tokens", "num_draft_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                     "repetition_penalty", "presence_penalty", "frequency_penalty", "end_id", "draft_model", "lora_name",
                     "cache_salt",
                     "apply_chat_template", "adaptive_draft", "num_draft_branches", "min_length", "ignore_eos",
                     "return_log_probs", "num_top_log_probs", "return_prompt_log_probs", "return_prompt_ids",
                     "return_generation_logits", "return_context_logits", "priority", "stream_interval_ms",
                     "thinking_token_budget"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        for name, words in ((tn.STOP_WORDS, self.stop_words), (tn.BAD_WORDS, self.bad_words)):
            if words:
                body[name] = list(words)
        for name, text in ((tn.GUIDED_DECODING_GUIDE_TYPE, self.guide_type), (tn.GUIDED_DECODING_GUIDE, self.guide),
                           (tn.REASONING_PARSER, self.reasoning_parser)):
            if text is not None:
                body[name] = text
        return body


@dataclass
class GenerationResult:
    text: str = ""
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    num_rounds: int = 0
    num_cached_tokens: int = 0  # of the prompt's tokens, those the server's prefix cache held
    chunks: list[str] = field(default_factory=list)  # text of each response, in order
    output_ids: list[int] = field(default_factory=list)  # the generated tokens (each response's output_ids)
    # With return_log_probs: the target's log-probability of each output token, and their sum
    log_probs: list[float] = field(default_factory=list)
    cum_log_probs: float = 0.0
    # With num_top_log_probs n: per output token its position's n most likely tokens, most likely first,
    # and their log-probabilities
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    # With return_prompt_log_probs: the prompt's tokens as the model read them (return_prompt_ids: these
    # alone), the log-probability of each after the first (one fewer) and its rank, and with num_top_log_probs
    # n those positions' n most likely tokens
    prompt_ids: list[int] = field(default_factory=list)
    prompt_log_probs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # 1: the most likely token there
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_log_probs: list[list[float]] = field(default_factory=list)
    # With return_generation_logits: each response's (tokens, V) float32 rows (generation_logits joins them);
    # with return_context_logits: (input tokens, V)
    generation_logit_parts: list[np.ndarray] = field(default_factory=list, repr=False)
    context_logits: np.ndarray | None = None
    ttft_s: float = 0.0  # request sent -> first response
    latency_s: float = 0.0  # request sent -> last response

    @property
    def generation_logits(self) -> np.ndarray | None:
        """(output tokens, V) float32: the target's raw logits at each generated position, with
        return_generation_logits."""
        return np.concatenate(self.generation_logit_parts) if self.generation_logit_parts else None

    @property
    def itl_s(self) -> float:
        """Inter-token latency (genai-perf): (latency - TTFT) / (output tokens - 1)."""
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    def stats_line(self) -> str:
        return (f"[{self.finish_reason}] {self.num_input_tokens} in ({self.num_cached_tokens} cached), "
                f"{self.num_output_tokens} out, "
                f"{self.num_rounds} rounds, acceptance {self.acceptance_rate:.2f} "
                f"({self.total_accepted_draft_tokens}/{self.total_draft_tokens}), "
                f"{self.mean_accepted_length:.2f} tokens/round, TTFT {self.ttft_s * 1000:.0f} ms, "
                f"ITL {self.itl_s * 1000:.1f} ms, {self.tokens_per_s:.1f} tokens/s")


_INT_FIELDS = (tn.NUM_INPUT_TOKENS, tn.NUM_OUTPUT_TOKENS, tn.TOTAL_DRAFT_TOKENS, tn.TOTAL_ACCEPTED_DRAFT_TOKENS,
               tn.NUM_ROUNDS, tn.NUM_CACHED_TOKENS)
_FLOAT_FIELDS = (tn.ACCEPTANCE_RATE, tn.MEAN_ACCEPTED_LENGTH, tn.CUM_LOG_PROBS)


class ResultBuilder:
    """Accumulates the responses of one request into a GenerationResult, timing them."""

    def __init__(self, num_top_log_probs: int | None = None):
        self.result = GenerationResult()
        self.top = num_top_log_probs or 0  # the rows' width (Triton's HTTP generate endpoint sends them flat)
        self.sent = time.perf_counter()
        self.first: float | None = None

    def add(self, fields: dict) -> str:
        """Add one response's fields (name -> python value); returns its text delta."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.result.ttft_s = now - self.sent
        self.result.latency_s = now - self.sent
        delta = fields.get(tn.TEXT_OUTPUT, "") or ""
        self.result.chunks.append(delta)
        self.result.text += delta
        if fields.get(tn.FINISH_REASON):
            self.result.finish_reason = fields[tn.FINISH_REASON]
        before = self.result.num_output_tokens
        for name in _INT_FIELDS:
            if name in fields:
                setattr(self.result, name, int(fields[name]))
        for name in _FLOAT_FIELDS:
            if name in fields:
                setattr(self.result, name, float(fields[name]))
        self._logits(fields, before)
        if tn.OUTPUT_LOG_PROBS in fields:  # a list; Triton's HTTP generate endpoint writes one value bare
            values = fields[tn.OUTPUT_LOG_PROBS]
            self.result.log_probs += [float(v) for v in (values if isinstance(values, list) else [values])]
        for name, into, kind in ((tn.OUTPUT_IDS, self.result.output_ids, int),
                                 (tn.OUTPUT_PROMPT_IDS, self.result.prompt_ids, int),
                                 (tn.OUTPUT_PROMPT_LOG_PROBS, self.result.prompt_log_probs, float),
                                 (tn.OUTPUT_PROMPT_RANKS, self.result.prompt_ranks, int)):
            if name in fields:
                into += [kind(v) for v in _flat(fields[name])]
        for name, into, kind in ((tn.OUTPUT_TOP_IDS, self.result.top_ids, int),
                                 (tn.OUTPUT_TOP_LOG_PROBS, self.result.top_log_probs, float),
                                 (tn.OUTPUT_PROMPT_TOP_IDS, self.result.prompt_top_ids, int),
                                 (tn.OUTPUT_PROMPT_TOP_LOG_PROBS, self.result.prompt_top_log_probs, float)):
            values = fields.get(name)
            if values is None or not self.top:
                continue
            flat = _flat(values)
            into += [[kind(v) for v in flat[i:i + self.top]] for i in range(0, len(flat), self.top)]
        return delta

    def _logits(self, fields: dict, before: int) -> None:
        """A response's logits (flat where Triton's HTTP generate endpoint sent them): its generated tokens' rows
        (num_output_tokens counts them all so far), the prompt's (num_input_tokens rows)."""
        values = fields.get(tn.GENERATION_LOGITS)
        rows = self.result.num_output_tokens - before
        if values is not None and rows > 0:  # (joined once, when read: a long stream's are many)
            self.result.generation_logit_parts.append(np.asarray(values, dtype=np.float32).reshape(rows, -1))
        values = fields.get(tn.CONTEXT_LOGITS)
        if values is not None and self.result.num_input_tokens:
            self.result.context_logits = np.array(values, dtype=np.float32).reshape(self.result.num_input_tokens, -1)


def fields_from_infer_result(result) -> dict:
    """Python values of a tritonclient InferResult's outputs."""
    out = {}
    for name in (tn.TEXT_OUTPUT, tn.FINISH_REASON, *_INT_FIELDS, *_FLOAT_FIELDS):
        value = result.as_numpy(name)
        if value is None or value.size == 0:
            continue
        item = value.reshape(-1)[0]
        out[name] = item.decode("utf-8") if isinstance(item, bytes) else item.item()
    log_probs = result.as_numpy(tn.OUTPUT_LOG_PROBS)
    if log_probs is not None:
        out[tn.OUTPUT_LOG_PROBS] = log_probs.reshape(-1).tolist()
    for name in (tn.OUTPUT_IDS, tn.OUTPUT_TOP_IDS, tn.OUTPUT_TOP_LOG_PROBS, tn.OUTPUT_PROMPT_IDS,
                 tn.OUTPUT_PROMPT_LOG_PROBS, tn.OUTPUT_PROMPT_RANKS, tn.OUTPUT_PROMPT_TOP_IDS,
                 tn.OUTPUT_PROMPT_TOP_LOG_PROBS):
        values = result.as_numpy(name)
        if values is not None:
            out[name] = values.reshape(-1).tolist()
    for name in (tn.GENERATION_LOGITS, tn.CONTEXT_LOGITS):  # (as arrays: V floats a row)
        values = result.as_numpy(name)
        if values is not None:
            out[name] = values
    return out


def _flat(values) -> list:
    """A tensor's values as JSON gave them (nested lists, or one bare value), flattened."""
    if not isinstance(values, list):
        return [values]
    return [v for item in values for v in _flat(item)]


def server_url(url: str | None, protocol: str) -> str:
    """The address to call: gRPC host:port (default localhost:8001), or an HTTP base URL (localhost:8000)."""
    if protocol not in ("grpc", "http"):
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    url = url or ("localhost:8001" if protocol == "grpc" else "localhost:8000")
    if protocol == "http" and not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def classify_http_error(status: int, body: str) -> ClientError:
    """The error of a non-200 answer of Triton's HTTP endpoints (body: its JSON {"error": ...} or text), or of
    the OpenAI and Anthropic APIs ({"error": {"message": ..., "type": ...}})."""
    try:
        message = json.loads(body).get("error", body)
    except (ValueError, AttributeError):
        message = body
    if isinstance(message, dict):
        message = message.get("message", body)
    if not isinstance(message, str):
        message = body
    lowered = message.lower()
    if tn.RETRY_LATER in lowered:
        return ServerBusyError(message)
    if status in (404, 503) or (status == 400 and ("unknown model" in lowered or "not ready" in lowered)):
        return ModelNotReadyError(message)
    if status == 400:
        return InvalidArgumentError(message)
    return classify_error(message, str(status))


def classify_error(message: str, status: str = "") -> ClientError:
    """Turn a server or transport error into the client's error types."""
    text = f"{status} {message}"
    lowered = text.lower()
    if "unavailable" in lowered and ("connect" in lowered or "refused" in lowered) or "connection refused" in lowered:
        return ServerUnavailableError(message)
    if "deadline" in lowered or "timed out" in lowered or "timeout" in lowered:
        return GenerationTimeoutError(message)
    if tn.RETRY_LATER in lowered:  # the server's capacity refusals (a gRPC stream's error has no status)
        return ServerBusyError(message)
    if ("unknown model" in lowered or "not ready" in lowered or "not found" in lowered or tn.MODEL_DOWN in lowered
            or "is not healthy" in lowered):  # a model down or being restored (the launcher's watchdog)
        return ModelNotReadyError(message)
    # Streamed errors carry no status code: recognise the server's wording (ours name "input '<field>'";
    # Triton's own input checks say "inference input").
    if any(marker in lowered for marker in ("invalid_arg", "invalid argument", "input '", "inference input",
                                            "unexpected inference input")):
        return InvalidArgumentError(message)
    return ClientError(message)
