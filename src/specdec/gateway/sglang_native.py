"""SGLang's native API, as `sglang.launch_server` serves it beside its OpenAI one: POST /generate, GET
/get_server_info and /get_model_info (and their newer names /server_info, /model_info), GET /health_generate.
A client written for an SGLang server (SGLang's `bench_serving --backend sglang`, its frontend language's
RuntimeEndpoint, RL rollout workers that send token ids) reaches this server unchanged, as the launcher already
takes SGLang's command line (speculative_config.from_sglang).

A /generate request is a /v1/completions request in other words: `text` or `input_ids` (one prompt, or a batch
as a list), `sampling_params` (one object, or one per prompt), `stream`, `rid`, `return_logprob` with
`top_logprobs_num` and `logprob_start_len`, `lora_path` (an adapter's served name). It is turned into the
completions body it stands for (`completion_bodies`) and answered by the same path; the answer is SGLang's:
per output `{"text", "output_ids", "meta_info"}`, a list for a batch, streamed as SSE events whose `text` and
`output_ids` hold everything so far (SGLang's default; with its --incremental-streaming-output, what each event
adds: `incremental`), then `[DONE]`.
meta_info carries SGLang's speculative figures (`spec_verify_ct`: the rounds, `spec_accept_length`: tokens per
round) from the server's statistics.

Refused by name: multimodal and embedding inputs, hidden states, custom logit processors, `token_ids_logprob`,
input log-probabilities in a stream, disaggregation's bootstrap fields, any field SGLang does not define.
Pure: bodies in, bodies out (the Gateway does the I/O).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specdec import tensor_names as tn
from specdec.gateway.protocol import ApiError, invalid
from specdec.gateway.vllm_metrics import samples

GENERATE_PATH = "/generate"
SERVER_INFO_PATHS = ("/get_server_info", "/server_info")  # the second: SGLang's newer name for the same
MODEL_INFO_PATHS = ("/get_model_info", "/model_info")
HEALTH_GENERATE_PATH = "/health_generate"  # a one-token generation: the whole path serving (no API key, as /health)
# GET or POST: the server's caches across requests reset (cache_reset.py), answered with FLUSHED
FLUSH_CACHE_PATH, FLUSHED = "/flush_cache", "Cache flushed.\n"
# behind --api-key, as on SGLang
KEYED_PATHS = frozenset({GENERATE_PATH, *SERVER_INFO_PATHS, *MODEL_INFO_PATHS, FLUSH_CACHE_PATH})
# SGLang's --incremental-streaming-output, as the launcher hands it to the API: "1" on
INCREMENTAL_ENV = "SPECDEC_INCREMENTAL_STREAMING_OUTPUT"
INCREMENTAL_KEYS = ("output_token_logprobs", "output_top_logprobs")  # meta_info's per-token lists, sliced too
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's: a server that cannot generate one token in this is unhealthy
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default (OpenAI's completions: 16)

# sampling_params keys -> the completions field each stands for (vLLM's names, which protocol.py takes)
SAMPLING = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
            "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "stop": "stop",
            "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
            "skip_special_tokens": "skip_special_tokens",
            "spaces_between_special_tokens": "spaces_between_special_tokens",
            "no_stop_trim": "include_stop_str_in_output", "n": "n", "sampling_seed": "seed", "logit_bias": "logit_bias",
            "stream_interval": "stream_interval"}
# sampling_params' constraints -> the key of vLLM's `structured_outputs` each stands for (one at most)
CONSTRAINTS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}
# SGLang's that change nothing here: the server's own dtype
IGNORED_SAMPLING = ("dtype",)
IGNORED = ("log_metrics", "stream_options", "modalities", "session_params", "data_parallel_rank", "routed_dp_rank",
           "background", "extra_key", "no_logs", "received_time", "conversation_id")
REFUSED = {"input_embeds": "embeddings as input are not served (send text or input_ids)",
           "image_data": "images are not served: the models here read text",
           "video_data": "videos are not served: the models here read text",
           "audio_data": "audio is not served: the models here read text",
           "token_ids_logprob": "is not supported (top_logprobs_num gives each position's most likely tokens)",
           "custom_logit_processor": "custom logit processors are not run here (code sent by a client)",
           "return_hidden_states": "hidden states are not returned", "return_routed_experts": "no experts here",
           "bootstrap_host": "prefill/decode disaggregation is not served",
           "bootstrap_port": "prefill/decode disaggregation is not served",
           "bootstrap_room": "prefill/decode disaggregation is not served",
           "lora_id": "name the adapter with lora_path (its served name)"}
FIELDS = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
          "return_text_in_logprobs", "stream", "lora_path", "priority", *IGNORED, *REFUSED)
# completions fields (as protocol.py names them in its errors) -> the SGLang field a client sent
RENAMED = {**{name: f"sampling_params.{key}" for key, name in SAMPLING.items()}, "prompt": "text",
           "logprobs": "top_logprobs_num", "prompt_logprobs": "logprob_start_len", "request_id": "rid",
           "model": "lora_path", "structured_outputs": "sampling_params"}


def renamed(error: ApiError) -> ApiError:
    """An error about the completions request, about the /generate request it came from."""
    if error.param in RENAMED:
        name = RENAMED[error.param]  # (the word alone: "n" is in "in ensemble" too)
        message = re.sub(rf"(?<![\w.]){re.escape(error.param)}(?!\w)", name, error.message)
        # another field's value it is checked against, named so too: "within [0, max_tokens=1]"
        message = _BOUND.sub(lambda bound: f"{RENAMED[bound.group(1)]}=", message)
        return ApiError(error.status, message, name, error.code)
    return error


_BOUND = re.compile(r"(?<![\w.])(max_tokens)=")


@dataclass
class Native:
    """A /generate request's own settings, besides the completions bodies it stands for."""

    batch: bool  # a list of prompts: the answer is a list
    n: int
    rids: list[str | None]  # per prompt (None: the server names it)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no input log-probabilities
    return_text_in_logprobs: bool = False
    stream: bool = False
    # max_new_tokens 0 (what RL trainers and SGLang's `select` send for the prompt's log-probabilities): the
    # server generates one token, never shown (as the completions endpoint's echo with max_tokens 0)
    score_only: bool = False
    stops: list[list[str]] = field(default_factory=list)  # per prompt: its stop strings
    stop_ids: list[list[int]] = field(default_factory=list)  # per prompt: its stop token ids

    def output_id(self, index: int, fallback: str) -> str:
        """Output `index`'s meta_info.id: its prompt's rid (with n > 1: rid-j), else `fallback`."""
        rid = self.rids[index // self.n]
        if rid is None:
            return fallback
        return rid if self.n == 1 else f"{rid}-{index % self.n}"


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, "must be a boolean")
    return value


def _prompts(body: dict) -> tuple[list, bool]:
    """(the prompts: strings or lists of token ids, whether the request is a batch)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise invalid("text", "give text or input_ids, not both")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise invalid("text", "must be a string or a non-empty list of strings")
    if ids is not None:
        def is_ids(value) -> bool:
            return isinstance(value, list) and bool(value) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value)
        if is_ids(ids):
            return [list(ids)], False
        if isinstance(ids, list) and ids and all(is_ids(row) for row in ids):
            return [list(row) for row in ids], True
        raise invalid("input_ids", "must be a non-empty list of token ids or a non-empty list of such lists")
    raise invalid("text", "is required (or input_ids)")


def _per_prompt(body: dict, name: str, count: int, kind: type, what: str) -> list:
    """A field given once or as a list with one value per prompt (SGLang takes both), per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise invalid(name, f"a list must hold one value per prompt ({count}), got {len(value)}")
        values = value
    else:
        values = [value] * count
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise invalid(name, f"must be {what} or a list of them, one per prompt")
    return values


def _sampling(params, where: str) -> dict:
    """One sampling_params object -> completions fields."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise invalid(where, "must be an object")
    out, constraint = {}, {}
    for key, value in params.items():
        if key in SAMPLING:
            if value is not None and not (key == "top_k" and value == -1):  # -1: SGLang's "no top-k"
                out[SAMPLING[key]] = value
        elif key in CONSTRAINTS:
            if value is not None:
                constraint[CONSTRAINTS[key]] = value
        elif key in ("custom_params",):
            raise invalid(f"{where}.{key}", "custom logit processors are not run here")
        elif key not in IGNORED_SAMPLING:
            raise invalid(f"{where}.{key}", f"unrecognized (SGLang's: {', '.join([*SAMPLING, *CONSTRAINTS])})")
    if len(constraint) > 1:
        names = [key for key in CONSTRAINTS if params.get(key) is not None]
        raise invalid(f"{where}.{names[1]}", f"give one constraint ({' or '.join(names)})")
    if constraint:
        out["structured_outputs"] = constraint
    out.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    return out


def completion_bodies(body, model: str) -> tuple[Native, list[dict]]:
    """A /generate body -> (its own settings, the completions bodies it stands for: one for the whole request
    when its prompts share their sampling_params, else one per prompt). ApiError naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise invalid(name, "unrecognized (SGLang's /generate fields: " + ", ".join(FIELDS[:11]) + ")")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, [], {}):
            raise invalid(name, why)
    prompts, batch = _prompts(body)
    params = body.get("sampling_params")
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise invalid("sampling_params", f"a list must hold one object per prompt ({len(prompts)}), "
                                             f"got {len(params)}")
        per_prompt = [_sampling(p, f"sampling_params.{i}") for i, p in enumerate(params)]
    else:
        per_prompt = [_sampling(params, "sampling_params")] * len(prompts)
    for p in per_prompt:
        n = p.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise invalid("sampling_params.n", "must be a positive integer")
    counts = {p.get("n", 1) for p in per_prompt}
    if len(counts) > 1:
        raise invalid("sampling_params", "n must be the same for every prompt")
    n = counts.pop()
    zero = [p["max_tokens"] == 0 for p in per_prompt]
    if any(zero) and not all(zero):
        raise invalid("sampling_params.max_new_tokens", "0 (the prompt's log-probabilities alone) for every prompt "
                                                        "of a batch or none")
    if all(zero):
        per_prompt = [{**p, "max_tokens": 1} for p in per_prompt]
    rids = _per_prompt(body, "rid", len(prompts), str, "a string")
    stream = _flag(body, "stream")
    native = Native(batch=batch, n=n, rids=rids, stream=stream, score_only=all(zero),
                    return_logprob=_flag(body, "return_logprob"),
                    return_text_in_logprobs=_flag(body, "return_text_in_logprobs"))
    top = body.get("top_logprobs_num")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= tn.MAX_TOP_LOG_PROBS:
            raise invalid("top_logprobs_num", f"must be an integer within [0, {tn.MAX_TOP_LOG_PROBS}]")
        native.top_logprobs_num = top
    start = body.get("logprob_start_len")
    if start is not None:
        if not isinstance(start, int) or isinstance(start, bool) or start < -1:
            raise invalid("logprob_start_len", "must be an integer, -1 (the output's alone) or a prompt position")
        native.logprob_start_len = start
    if native.logprob_start_len >= 0 and native.return_logprob and stream:
        raise invalid("logprob_start_len", "input log-probabilities are not available in a stream (-1 there)")
    common = {"model": model, "stream": stream}
    lora = body.get("lora_path")
    if lora is not None:
        if not isinstance(lora, str) or not lora:
            raise invalid("lora_path", "must be an adapter's served name (a string)")
        common["model"] = lora
    if body.get("priority") is not None:
        common["priority"] = body["priority"]
    if native.return_logprob:
        common["logprobs"] = native.top_logprobs_num
        if native.logprob_start_len >= 0:
            common["prompt_logprobs"] = native.top_logprobs_num
    native.stops = [_strings(p.get("stop")) for p in per_prompt]
    native.stop_ids = [_ids(p.get("stop_token_ids")) for p in per_prompt]  # (the server checks their values)
    if all(p == per_prompt[0] for p in per_prompt) and len(set(map(type, prompts))) == 1:
        bodies = [{**common, **per_prompt[0], "prompt": prompts if batch else prompts[0]}]
    else:
        bodies = [{**common, **p, "prompt": prompt} for p, prompt in zip(per_prompt, prompts)]
    if rids[0] is not None and not batch:
        bodies[0]["request_id"] = rids[0]
    return native, bodies


def _ids(given) -> list[int]:
    return [t for t in given if isinstance(t, int)] if isinstance(given, list) else []


def _strings(stop) -> list[str]:
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []


def finish_reason(reason: str | None, ids: list[int], max_new_tokens: int, matched: str | None) -> dict | None:
    """SGLang's finish_reason object: {"type": "length", "length": max_new_tokens}, {"type": "stop", "matched":
    the stop string, or the token that ended it}; None while a stream goes on."""
    if not reason:
        return None
    if reason == "length":
        return {"type": "length", "length": max_new_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": matched if matched is not None else (ids[-1] if ids else None)}
    return {"type": "abort", "message": reason}


def spec_info(stats: dict, completion_tokens: int) -> dict:
    """SGLang's speculative figures of one output from the server's statistics (none without them)."""
    rounds = int(stats.get(tn.NUM_ROUNDS, 0))
    if not rounds:
        return {}
    drafted = int(stats.get(tn.TOTAL_DRAFT_TOKENS, 0))
    accepted = int(stats.get(tn.TOTAL_ACCEPTED_DRAFT_TOKENS, 0))
    return {"spec_verify_ct": rounds, "spec_accept_length": completion_tokens / rounds,
            "spec_draft_token_num": drafted, "spec_accept_token_num": accepted,
            "spec_accept_rate": accepted / drafted if drafted else 0.0}


def token_logprobs(values: list, ids: list[int], name=None) -> list[list]:
    """SGLang's [logprob, token id, text or None] per token (`name`: the token's text, with
    return_text_in_logprobs)."""
    return [[value, token, name(token) if name is not None else None] for value, token in zip(values, ids)]


def top_logprobs(rows_ids: list, rows_values: list, k: int, name=None) -> list:
    """SGLang's per position list of its k most likely [logprob, token id, text or None] (None: no row)."""
    return [None if row is None else token_logprobs(values[:k], row[:k], name)
            for row, values in zip(rows_ids, rows_values)]


def incremental(output: dict, sent_chars: int, sent_ids: int) -> dict:
    """A streamed event under --incremental-streaming-output: what `output` (the output so far, as `text`,
    `output_ids` and meta_info's per-token log-probabilities) adds to the first sent_chars characters and
    sent_ids tokens already sent; the rest of meta_info (counts, finish reason, figures) as it is, as SGLang does."""
    meta = dict(output["meta_info"])
    for key in meta.keys() & set(INCREMENTAL_KEYS):
        meta[key] = meta[key][sent_ids:]
    return {"text": output["text"][sent_chars:], "output_ids": output["output_ids"][sent_ids:], "meta_info": meta}


def server_figures(server_metrics: str) -> tuple[float | None, float]:
    """(SGLang's avg_spec_accept_length over the server's life: tokens per round among the rounds that drafted,
    1 + accepted drafts / those rounds, None before any drafted; the tokens generated so far), from the
    server's Prometheus text."""
    found = samples(server_metrics)

    def total(name: str) -> float:
        return sum(value for _, value in found.get(name, []))
    rounds = total("specdec_accepted_length_count")
    length = 1.0 + total("specdec_accepted_draft_tokens_total") / rounds if rounds else None
    return length, total("specdec_output_tokens_total")
