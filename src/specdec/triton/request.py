"""A `speculative_decoding` request's inputs, validated: `ParsedRequest.parse` over plain numpy arrays.

No `pb_utils` here: the adapter hands in a lookup from input name to array, so every rule is unit-tested
without a server. Every error names the input it refuses.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specdec import tensor_names as tn
from specdec.decoding.grammar import Grammar, GuideError
from specdec.decoding.logit_bias import MAX_ABS_BIAS, TokenBias
from specdec.decoding.loop import GenerationRequest
from specdec.decoding.penalties import Penalties
from specdec.decoding.sampling import SamplingParams
from specdec.triton.config import ModelParameters

InputLookup = Callable[[str], "np.ndarray | None"]  # input name -> its array, None when the request has none
Encode = Callable[[str], "list[int]"]  # text -> token ids, without special tokens (the target's tokenizer)
CompileGuide = Callable[[str, str], Grammar]  # (guide type, guide) -> its grammar; raises GuideError


class InputError(ValueError):
    """A bad request input; the message names the field."""


# vLLM's Triton backend takes its sampling settings as one JSON string (`sampling_parameters`); these keys
# are inputs of ours under another form (vLLM's top_k -1 is "off", our 0). Any other key is refused by name.
SAMPLING_PARAMETER_KEYS = {
    "max_tokens": (tn.MAX_TOKENS, np.int32), "temperature": (tn.TEMPERATURE, np.float32),
    "top_p": (tn.TOP_P, np.float32), "top_k": (tn.TOP_K, np.int32), "min_p": (tn.MIN_P, np.float32),
    "seed": (tn.SEED, np.uint64),
    "min_tokens": (tn.MIN_TOKENS, np.int32), "ignore_eos": (tn.IGNORE_EOS, np.bool_),
    "stop": (tn.STOP_WORDS, np.object_), "bad_words": (tn.BAD_WORDS, np.object_),
    "repetition_penalty": (tn.REPETITION_PENALTY, np.float32), "presence_penalty": (tn.PRESENCE_PENALTY, np.float32),
    "frequency_penalty": (tn.FREQUENCY_PENALTY, np.float32),
}
# Settings vLLM's clients send at their neutral values: accepted at those (or null), refused otherwise.
# (The text is always detokenized without special tokens, as vLLM's defaults do.)
NEUTRAL_SAMPLING_PARAMETERS = {"n": 1, "best_of": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                               "detokenize": True}
# vLLM's keys that no input stands for: token ids (and biases), read from the JSON into arrays of these names ...
TOKEN_ID_KEYS = ("logit_bias", "allowed_token_ids", "stop_token_ids")
# ... and these settings: the stop string kept at the text's end, and the prompt cut to its last N tokens
# (-1: as many as fit before max_tokens in the context).
VLLM_KEYS = {"include_stop_str_in_output": np.bool_, "truncate_prompt_tokens": np.int32}
MAX_TOKEN_IDS = 1024  # entries in logit_bias or stop_token_ids
# vLLM's structured-output settings (an object, or its JSON): one of these keys names the guide ...
GUIDED_DECODING_KEYS = ("guided_decoding", "structured_outputs")
GUIDE_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar",
              "json_object": "json"}
# ... and these may come at their neutral values (`backend`: any; this server has one), but for
# `disable_any_whitespace`: true makes a JSON guide compact (llguidance's whitespace_flexible: false).
NEUTRAL_GUIDE_KEYS = {"whitespace_pattern": None, "disable_fallback": False, "disable_additional_properties": False}


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask for, from speculative_decoding's config parameters (validated at load)."""

    vocab_size: int  # token ids a request may name (end_id)
    draft_names: tuple[str, ...]  # draft methods a request may choose; the first is the default
    default_end_ids: frozenset[int] = frozenset()
    max_context: int = tn.DEFAULT_MAX_CONTEXT_TOKENS
    max_max_tokens: int = tn.DEFAULT_MAX_MAX_TOKENS
    default_max_tokens: int = tn.DEFAULT_MAX_TOKENS
    max_num_draft_tokens: int = tn.DEFAULT_MAX_NUM_DRAFT_TOKENS
    default_num_draft_tokens: int = tn.DEFAULT_NUM_DRAFT_TOKENS
    adaptive_draft: bool = True  # num_draft_tokens is the most a round drafts; K adapts per round
    max_stop_words: int = 16
    max_bad_words: int = 16
    # A guide compiles when its request arrives (a large one on a thread, a small one on the orchestrator's
    # event loop); compiling grows with the guide (README, "Structured output"), so its length is bounded.
    max_guide_chars: int = 65536

    @classmethod
    def from_parameters(cls, params: ModelParameters, vocab_size: int, end_ids: frozenset[int]) -> RequestLimits:
        max_max_tokens = params.int("max_max_tokens", tn.DEFAULT_MAX_MAX_TOKENS, low=1)
        max_k = params.int("max_num_draft_tokens", tn.DEFAULT_MAX_NUM_DRAFT_TOKENS, low=0)
        draft_names = tuple(params.list("draft_models", tn.DRAFT_MODEL_NAME))
        if not draft_names:
            raise ValueError(f"{params.model_name}: parameter 'draft_models' lists no model")
        return cls(
            vocab_size=vocab_size, draft_names=draft_names, default_end_ids=end_ids,
            max_context=params.int("max_context_tokens", tn.DEFAULT_MAX_CONTEXT_TOKENS, low=2),
            max_max_tokens=max_max_tokens,
            default_max_tokens=params.int("default_max_tokens", tn.DEFAULT_MAX_TOKENS, low=1, high=max_max_tokens),
            max_num_draft_tokens=max_k,
            default_num_draft_tokens=params.int("default_num_draft_tokens", tn.DEFAULT_NUM_DRAFT_TOKENS, low=0,
                                                high=max_k),
            adaptive_draft=params.bool("adaptive_draft", True),
            max_stop_words=params.int("max_stop_words", 16, low=0),
            max_bad_words=params.int("max_bad_words", 16, low=0),
            max_guide_chars=params.int("max_guide_chars", 65536, low=1),
        )


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    num_draft_tokens: int  # K: every round's (fixed) or the most a round drafts (adaptive)
    adaptive: bool
    draft_name: str  # which proposer drafts
    stream: bool
    stop_words: tuple[str, ...]
    include_stop: bool = False  # the stop word that ends the text stays at its end (vLLM's include_stop_str_in_output)

    @classmethod
    def parse(cls, lookup: InputLookup, limits: RequestLimits, seq_id: int | None = None,
              encode: Encode | None = None, compile_guide: CompileGuide | None = None) -> ParsedRequest:
        """Validate a request's inputs against `limits`; raises InputError naming the input.

        seq_id keys both models' KV caches; by default a fresh random one (nonzero: 0 means "no
        sequence" to Triton). `encode` turns bad words into token sequences and `compile_guide` a guide
        into its grammar (each required when a request has any)."""
        inputs = _Inputs(_with_sampling_parameters(lookup))
        prompt_ids = inputs.array(tn.INPUT_IDS, np.int32)
        if prompt_ids is None or prompt_ids.size == 0:
            raise InputError(f"input '{tn.TEXT_INPUT}' is empty: the prompt needs at least one token")
        prompt_ids = prompt_ids.reshape(-1).tolist()
        max_tokens = inputs.scalar(tn.MAX_TOKENS, np.int32, limits.default_max_tokens)
        if not 1 <= max_tokens <= limits.max_max_tokens:
            raise InputError(f"input '{tn.MAX_TOKENS}' must be within [1, {limits.max_max_tokens}], got {max_tokens}")
        prompt_ids = _truncated(prompt_ids, inputs.scalar("truncate_prompt_tokens", np.int32, None),
                                limits.max_context - max_tokens)
        if len(prompt_ids) + max_tokens > limits.max_context:
            raise InputError(
                f"input '{tn.TEXT_INPUT}' has {len(prompt_ids)} tokens; with '{tn.MAX_TOKENS}'={max_tokens} that "
                f"exceeds the model context of {limits.max_context} tokens")
        k = inputs.scalar(tn.NUM_DRAFT_TOKENS, np.int32, limits.default_num_draft_tokens)
        if not 0 <= k <= limits.max_num_draft_tokens:
            raise InputError(
                f"input '{tn.NUM_DRAFT_TOKENS}' must be within [0, {limits.max_num_draft_tokens}], got {k}")
        adaptive = bool(inputs.scalar(tn.ADAPTIVE_DRAFT, np.bool_, limits.adaptive_draft))
        temperature = inputs.scalar(tn.TEMPERATURE, np.float32, tn.DEFAULT_TEMPERATURE)
        if not 0.0 <= temperature < float("inf"):  # also rejects NaN
            raise InputError(f"input '{tn.TEMPERATURE}' must be a finite number >= 0, got {temperature}")
        top_k = inputs.scalar(tn.TOP_K, np.int32, tn.DEFAULT_TOP_K)
        if top_k < 0:
            raise InputError(f"input '{tn.TOP_K}' must be >= 0, got {top_k}")
        top_p = inputs.scalar(tn.TOP_P, np.float32, tn.DEFAULT_TOP_P)
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"input '{tn.TOP_P}' must be within (0, 1], got {top_p}")
        min_p = inputs.scalar(tn.MIN_P, np.float32, tn.DEFAULT_MIN_P)
        if not 0.0 <= min_p <= 1.0:  # also rejects NaN
            raise InputError(f"input '{tn.MIN_P}' must be within [0, 1], got {min_p}")
        seed = inputs.scalar(tn.SEED, np.uint64, None)
        penalties = _penalties(inputs)
        end_id = inputs.scalar(tn.END_ID, np.int32, None)
        if end_id is not None and not 0 <= end_id < limits.vocab_size:
            raise InputError(f"input '{tn.END_ID}' must be a token id within [0, {limits.vocab_size}), got {end_id}")
        min_length = _min_length(inputs, max_tokens)
        ignore_eos = bool(inputs.scalar(tn.IGNORE_EOS, np.bool_, False))
        # vLLM's stop_token_ids: end tokens besides the end id (ignore_eos leaves them), dropped from the text.
        stop_ids = frozenset(_token_ids(inputs, "stop_token_ids", limits.vocab_size) or [])
        stop_words = inputs.words(tn.STOP_WORDS, limits.max_stop_words)
        bad_words = tuple(_bad_word_ids(word, encode) for word in inputs.words(tn.BAD_WORDS, limits.max_bad_words))
        names = inputs.strings(tn.DRAFT_MODEL)
        draft_name = names[0] if names else limits.draft_names[0]
        if len(names) > 1 or draft_name not in limits.draft_names:
            raise InputError(f"input '{tn.DRAFT_MODEL}' must be one of {sorted(limits.draft_names)}, got {names}")
        sampling = SamplingParams(temperature, top_k, top_p, seed, min_p)
        generation = GenerationRequest(
            seq_id=seq_id if seq_id is not None else random.getrandbits(63) | 1,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            end_ids=stop_ids | (frozenset() if ignore_eos else limits.default_end_ids if end_id is None
                                else frozenset([end_id])),
            min_tokens=min_length,
            log_probs=bool(inputs.scalar(tn.RETURN_LOG_PROBS, np.bool_, False)),
            bad_words=bad_words,
            penalties=penalties,
            grammar=_grammar(inputs, compile_guide, limits.max_guide_chars),
            token_bias=_token_bias(inputs, limits.vocab_size),
        )
        # A seeded sampled request must be reproducible: measured costs vary from run to run, and a
        # different K changes which random draws pick which token, so it drafts a fixed K.
        adaptive = adaptive and (sampling.greedy or seed is None)
        return cls(generation, k, adaptive, draft_name, bool(inputs.scalar(tn.STREAM, np.bool_, False)), stop_words,
                   bool(inputs.scalar("include_stop_str_in_output", np.bool_, False)))


def _truncated(prompt_ids: list[int], keep: int | None, room: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the last `room`, what fits before
    max_tokens in the context); the whole prompt when it is shorter, or without the setting."""
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max(room, 1)
    if keep < 1:
        raise InputError(f"input '{tn.SAMPLING_PARAMETERS}': key 'truncate_prompt_tokens' must be >= 1 or -1, got {keep}")
    return prompt_ids[-keep:]


def _with_sampling_parameters(lookup: InputLookup) -> InputLookup:
    """`lookup`, with the keys of a `sampling_parameters` JSON (vLLM's form) as the inputs they stand for."""
    raw = lookup(tn.SAMPLING_PARAMETERS)
    if raw is None:
        return lookup
    field = f"input '{tn.SAMPLING_PARAMETERS}'"
    if raw.size != 1:
        raise InputError(f"{field} must hold exactly one JSON string, got {raw.size}")
    try:
        text = raw.reshape(-1)[0]
        settings = json.loads(text.decode("utf-8") if isinstance(text, bytes) else str(text))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise InputError(f"{field} must be a JSON object, got {type(settings).__name__}")
    arrays: dict[str, np.ndarray] = {}
    for key, value in settings.items():
        if key in TOKEN_ID_KEYS and value is not None:
            arrays.update(_token_id_setting(f"{field}: key {key!r}", key, value))
            continue
        if key in GUIDED_DECODING_KEYS and value is not None:
            for name in (tn.GUIDED_DECODING_GUIDE_TYPE, tn.GUIDED_DECODING_GUIDE):
                if lookup(name) is not None or name in arrays:
                    raise InputError(f"{field}: key {key!r} and input '{name}' (or another such key) are one setting; "
                                     f"send one of them")
            arrays.update(_guide_setting(f"{field}: key {key!r}", value))
            continue
        if value is None:
            continue  # unset
        if key in VLLM_KEYS:
            arrays[key] = _setting(f"{field}: key {key!r}", value, VLLM_KEYS[key])
            continue
        if key in NEUTRAL_SAMPLING_PARAMETERS:
            neutral = NEUTRAL_SAMPLING_PARAMETERS[key]
            if _setting(f"{field}: key {key!r}", value, np.bool_ if isinstance(neutral, bool) else np.int32).item() \
                    != neutral:
                raise InputError(f"{field}: key {key!r} is supported only at {json.dumps(neutral)}, got {value!r}")
            continue  # a setting speculative decoding does not have, at its neutral value
        if key not in SAMPLING_PARAMETER_KEYS:
            raise InputError(f"{field}: key {key!r} is not supported (supported: {', '.join(SAMPLING_PARAMETER_KEYS)}, "
                             f"{', '.join(TOKEN_ID_KEYS + tuple(VLLM_KEYS) + GUIDED_DECODING_KEYS)}; "
                             f"at their neutral values: {', '.join(NEUTRAL_SAMPLING_PARAMETERS)})")
        name, dtype = SAMPLING_PARAMETER_KEYS[key]
        if lookup(name) is not None:
            raise InputError(f"{field}: key {key!r} and input '{name}' are one setting; send one of them")
        arrays[name] = _setting(f"{field}: key {key!r}", value, dtype)
        if key == "top_k" and arrays[name].item() == -1:
            arrays[name] = np.zeros((1, 1), dtype=np.int32)
    return lambda name: arrays[name] if name in arrays else lookup(name)


def _token_id_setting(what: str, key: str, value) -> dict[str, np.ndarray]:
    """logit_bias ({token id: bias}, ids also as strings, as JSON keys are) or a list of token ids, as
    arrays named by the key (ids; with logit_bias also `logit_bias.values`). Ranges are checked in parse."""
    if key == "logit_bias":
        if not isinstance(value, dict):
            raise InputError(f"{what} must be an object of token id: bias, got {type(value).__name__}")
        items = list(value.items())
    else:
        if not isinstance(value, list):
            raise InputError(f"{what} must be a list of token ids, got {type(value).__name__}")
        items = [(token, 0.0) for token in value]
    if len(items) > MAX_TOKEN_IDS and key != "allowed_token_ids":  # that one may list much of the vocabulary
        raise InputError(f"{what} has {len(items)} entries; at most {MAX_TOKEN_IDS}")
    ids, values = [], []
    for token, bias in items:
        try:
            ids.append(int(token) if not isinstance(token, (bool, float)) else None)
        except ValueError:
            ids.append(None)
        if ids[-1] is None:
            raise InputError(f"{what}: {token!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_ABS_BIAS <= bias <= MAX_ABS_BIAS:
            raise InputError(f"{what}: the bias of token {token} must be a number within "
                             f"[-{MAX_ABS_BIAS:g}, {MAX_ABS_BIAS:g}], got {bias!r}")
        values.append(float(bias))
    if len(set(ids)) != len(ids):
        raise InputError(f"{what} names a token id twice")
    arrays = {key: np.array([ids], dtype=np.int64)}
    if key == "logit_bias":
        arrays["logit_bias.values"] = np.array([values], dtype=np.float32)
    return arrays


def _token_ids(inputs: _Inputs, key: str, vocab_size: int) -> list[int] | None:
    """A TOKEN_ID_KEYS setting's ids, each a token of the vocabulary; None when the request has none."""
    array = inputs.array(key, np.int64)
    if array is None:
        return None
    ids = array.reshape(-1).tolist()
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InputError(f"input '{tn.SAMPLING_PARAMETERS}': key {key!r}: token id {token} is not within "
                             f"[0, {vocab_size})")
    return ids


def _token_bias(inputs: _Inputs, vocab_size: int) -> TokenBias:
    biased = _token_ids(inputs, "logit_bias", vocab_size) or []
    allowed = _token_ids(inputs, "allowed_token_ids", vocab_size)
    if allowed is not None and not allowed:
        raise InputError(f"input '{tn.SAMPLING_PARAMETERS}': key 'allowed_token_ids' is empty: no token could follow")
    values = inputs.array("logit_bias.values", np.float32)
    return TokenBias(tuple(zip(biased, values.reshape(-1).tolist() if values is not None else [])),
                     None if allowed is None else frozenset(allowed))


def _guide_setting(what: str, value) -> dict[str, np.ndarray]:
    """vLLM's guided_decoding / structured_outputs object (or its JSON) as our two guide inputs."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InputError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError(f"{what} must be an object, got {type(value).__name__}")
    guides = {key: v for key, v in value.items() if key in GUIDE_KEYS and v is not None and v is not False}
    for key, v in value.items():
        if key in NEUTRAL_GUIDE_KEYS and v is not None and v != NEUTRAL_GUIDE_KEYS[key]:
            raise InputError(f"{what}: {key!r} is supported only at {NEUTRAL_GUIDE_KEYS[key]!r}, got {v!r}")
        if key not in GUIDE_KEYS and key not in NEUTRAL_GUIDE_KEYS and key not in ("backend", "disable_any_whitespace"):
            raise InputError(f"{what}: {key!r} is not supported (one of {', '.join(GUIDE_KEYS)})")
    if len(guides) != 1:
        raise InputError(f"{what} must set exactly one of {', '.join(GUIDE_KEYS)}, got {sorted(guides) or 'none'}")
    (key, guide), = guides.items()
    if key == "json_object":
        if guide is not True:
            raise InputError(f"{what}: 'json_object' must be true, got {guide!r}")
        guide = ""
    elif key in ("json", "choice") and not isinstance(guide, str):
        guide = json.dumps(guide)  # a schema object or a list of choices, as the guide's JSON text
    elif not isinstance(guide, str):
        raise InputError(f"{what}: {key!r} must be a string, got {type(guide).__name__}")
    compact = value.get("disable_any_whitespace")
    if compact not in (None, False, True):
        raise InputError(f"{what}: 'disable_any_whitespace' must be true or false, got {compact!r}")
    guide_type = GUIDE_KEYS[key]
    if compact and guide_type in ("json", "json_schema"):  # other guides say their whitespace themselves
        try:
            schema = json.loads(guide) if guide else {"type": "object"}
        except ValueError as exc:
            raise InputError(f"{what}: 'json' is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InputError(f"{what}: 'json' must be a JSON schema object")
        schema["x-guidance"] = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
        guide_type, guide = "json_schema", json.dumps(schema)
    return {tn.GUIDED_DECODING_GUIDE_TYPE: np.array([[guide_type]], dtype=np.object_),
            tn.GUIDED_DECODING_GUIDE: np.array([[guide]], dtype=np.object_)}


def _grammar(inputs: _Inputs, compile_guide: CompileGuide | None, max_chars: int) -> Grammar | None:
    """The request's structured-output grammar (TensorRT-LLM's two inputs), None when it has none."""
    types, guides = inputs.strings(tn.GUIDED_DECODING_GUIDE_TYPE), inputs.strings(tn.GUIDED_DECODING_GUIDE)
    for name, values in ((tn.GUIDED_DECODING_GUIDE_TYPE, types), (tn.GUIDED_DECODING_GUIDE, guides)):
        if len(values) > 1:
            raise InputError(f"input '{name}' must hold exactly one string, got {len(values)}")
    guide_type, guide = (types or [""])[0], (guides or [""])[0]
    if not guide_type:  # TensorRT-LLM's clients send "" for none
        if guide:
            raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE}' needs '{tn.GUIDED_DECODING_GUIDE_TYPE}' "
                             f"(one of {', '.join(tn.GUIDE_TYPES)})")
        return None
    if guide_type not in tn.GUIDE_TYPES:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE_TYPE}' must be one of {', '.join(tn.GUIDE_TYPES)}, "
                         f"got {guide_type!r}")
    if compile_guide is None:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE_TYPE}' is not supported here (no tokenizer)")
    if len(guide) > max_chars:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE}' has {len(guide)} characters; at most {max_chars} "
                         f"(max_guide_chars)")
    try:
        return compile_guide(guide_type, guide)
    except GuideError as exc:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE}' ({guide_type}): {exc}") from None


def _setting(what: str, value, dtype) -> np.ndarray:
    """One JSON setting as the (1, n) array its input would be. Numbers and booleans may come as strings
    (vLLM's backend converts them too)."""
    if dtype is np.object_:
        words = [value] if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
            raise InputError(f"{what} must be a string or a list of strings, got {value!r}")
        return np.array([words], dtype=np.object_).reshape(1, -1)
    if dtype is np.bool_:
        flag = {"true": True, "false": False}.get(value.lower()) if isinstance(value, str) else value
        if not isinstance(flag, bool):
            raise InputError(f"{what} must be true or false, got {value!r}")
        return np.array([[flag]])
    try:
        number = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or (dtype is not np.float32 and not number.is_integer()):
        raise InputError(f"{what} must be {'a number' if dtype is np.float32 else 'an integer'}, got {value!r}")
    if dtype is np.uint64 and number < 0:
        raise InputError(f"{what} must be >= 0, got {value!r}")
    return np.array([[number if dtype is np.float32 else int(number)]], dtype=dtype)


def _min_length(inputs: _Inputs, max_tokens: int) -> int:
    """min_length or min_tokens (one meaning, both names in use by clients); both only if they agree."""
    given = {name: value for name in (tn.MIN_LENGTH, tn.MIN_TOKENS)
             if (value := inputs.scalar(name, np.int32, None)) is not None}
    if len(set(given.values())) > 1:
        raise InputError(f"inputs '{tn.MIN_LENGTH}' and '{tn.MIN_TOKENS}' are one setting; got {given[tn.MIN_LENGTH]} "
                         f"and {given[tn.MIN_TOKENS]}")
    for name, value in given.items():
        if not 0 <= value <= max_tokens:
            raise InputError(f"input '{name}' must be within [0, {tn.MAX_TOKENS}={max_tokens}], got {value}")
    return next(iter(given.values()), 0)


def _penalties(inputs: _Inputs) -> Penalties:
    repetition = inputs.scalar(tn.REPETITION_PENALTY, np.float32, tn.DEFAULT_REPETITION_PENALTY)
    if not 0.0 < repetition < float("inf"):  # also rejects NaN
        raise InputError(f"input '{tn.REPETITION_PENALTY}' must be a finite number > 0 (1 = off), got {repetition}")
    limit = tn.MAX_ABS_PRESENCE_FREQUENCY_PENALTY
    values = []
    for name, default in ((tn.PRESENCE_PENALTY, tn.DEFAULT_PRESENCE_PENALTY),
                          (tn.FREQUENCY_PENALTY, tn.DEFAULT_FREQUENCY_PENALTY)):
        value = inputs.scalar(name, np.float32, default)
        if not -limit <= value <= limit:
            raise InputError(f"input '{name}' must be within [-{limit:g}, {limit:g}] (0 = off), got {value}")
        values.append(value)
    return Penalties(repetition, *values)


def _bad_word_ids(word: str, encode: Encode | None) -> tuple[int, ...]:
    if encode is None:
        raise InputError(f"input '{tn.BAD_WORDS}' is not supported here (no tokenizer)")
    ids = tuple(int(token) for token in encode(word))
    if not ids:
        raise InputError(f"input '{tn.BAD_WORDS}': {word!r} encodes to no token")
    return ids


class _Inputs:
    def __init__(self, lookup: InputLookup):
        self.lookup = lookup

    def array(self, name: str, dtype) -> np.ndarray | None:
        value = self.lookup(name)
        if value is None:
            return None
        if value.dtype != dtype:
            raise InputError(f"input '{name}' must be {np.dtype(dtype).name}, got {value.dtype.name}")
        return value

    def scalar(self, name: str, dtype, default):
        value = self.array(name, dtype)
        if value is None:
            return default
        if value.size != 1:
            raise InputError(f"input '{name}' must hold exactly one value, got shape {list(value.shape)}")
        return value.reshape(-1)[0].item()

    def words(self, name: str, most: int) -> tuple[str, ...]:
        """A list of words; empty strings are dropped (TensorRT-LLM's clients send [""] for none)."""
        words = tuple(word for word in self.strings(name) if word)
        if len(words) > most:
            raise InputError(f"input '{name}' has {len(words)} entries; at most {most}")
        return words

    def strings(self, name: str) -> list[str]:
        value = self.array(name, np.object_)
        if value is None:
            return []
        out = []
        for item in value.reshape(-1):
            try:
                out.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
            except UnicodeDecodeError:
                raise InputError(f"input '{name}' is not valid UTF-8") from None
        return out
