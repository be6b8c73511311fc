"""vLLM's form of a request's settings: one `sampling_parameters` JSON string (vLLM's Triton backend), or the
request's parameters, read into the inputs of ours they stand for, so that one parser validates every form.

Keys that are inputs of ours under another form (`SAMPLING_PARAMETER_KEYS`) become those inputs; token-id
settings (logit_bias, allowed_token_ids, stop_token_ids), vLLM's own settings and its structured-output
object become arrays the parser reads by their vLLM names; settings speculative decoding does not have
are accepted at their neutral values only; anything else is refused by name.
"""

from __future__ import annotations

import json
import math

import numpy as np

from specdec import tensor_names as tn
from specdec.decoding import json_text
from specdec.decoding.logit_bias import MAX_ABS_BIAS
from specdec.triton.inputs import InputError, InputLookup

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
    "thinking_token_budget": (tn.THINKING_TOKEN_BUDGET, np.int32),
    "lora_name": (tn.LORA_NAME, np.object_),  # vLLM's backend reads it from here
    tn.PREDICTION: (tn.PREDICTION, np.object_),  # this server's own: OpenAI's Predicted Outputs' text
}
# Settings vLLM's clients send at their neutral values: accepted at those (or null), refused otherwise.
NEUTRAL_SAMPLING_PARAMETERS = {"n": 1, "best_of": 1, "detokenize": True}
# Settings taken at either value that change nothing here: a fast tokenizer (the server's) writes no space
# between special tokens either way (vLLM's fast detokenizer does the same; its slow one reads it)
NO_EFFECT_PARAMETERS = {"spaces_between_special_tokens": np.bool_,
                        # TensorRT-LLM's BLS setting (its ensemble ignores the request's): a streamed response's text
                        # decoded from every token so far; here each response's text is always read so, and sent as
                        # the new text, as TensorRT-LLM's ensemble sends it (SGLang's bench_serving sends it)
                        "accumulate_tokens": np.bool_}
# vLLM's keys that no input stands for: token ids (and biases), read from the JSON into arrays of these names ...
TOKEN_ID_KEYS = ("logit_bias", "allowed_token_ids", "stop_token_ids")
# ... and these settings: the stop string kept at the text's end, the prompt cut to its last N tokens
# (-1: as many as fit before max_tokens in the context), and each generated token's N most likely tokens
# with its own log-probability and rank (sent as the JSON output `logprobs` with return_logprobs).
VLLM_KEYS = {"include_stop_str_in_output": np.bool_, "truncate_prompt_tokens": np.int32, "logprobs": np.int32,
             tn.SKIP_SPECIAL_TOKENS: np.bool_,  # false: the text keeps special tokens (a tool-call parser's)
             # this server's own: a streamed request's responses at most one per this many milliseconds (the
             # rounds between are sent together; 0: one per round)
             "stream_interval_ms": np.int32,
             # and at least this many tokens apart (SGLang's stream_interval; default: the server's)
             "stream_interval": np.int32,
             # and without max_tokens, what the context leaves (up to max_max_tokens), as OpenAI's API does
             tn.MAX_TOKENS_TO_CONTEXT: np.bool_}
# What each integer input holds, and float32's largest finite value
INT_RANGES = {np.int32: (-2**31, 2**31 - 1), np.int64: (-2**63, 2**63 - 1), np.uint64: (0, 2**64 - 1)}
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_TOKEN_IDS = 1024  # entries in logit_bias or stop_token_ids
# A request's parameters that Triton itself reads (besides its "triton_" ones): not sampling settings
TRITON_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                               "binary_data_output", "headers"})
# vLLM's structured-output settings (an object, or its JSON): one of these keys names the guide ...
GUIDED_DECODING_KEYS = ("guided_decoding", "structured_outputs")
GUIDE_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar",
              "json_object": "json", "structural_tag": "structural_tag"}
# ... this one at its neutral value ...
NEUTRAL_GUIDE_KEYS = {"disable_fallback": False}
# ... and these options: `backend` any (this server has one); `disable_any_whitespace`: true makes a JSON guide
# compact (llguidance's whitespace_flexible: false); `disable_additional_properties`: true closes a JSON guide's
# objects that leave additionalProperties unsaid (vLLM's guidance backend's, so that llguidance keeps to a
# schema's properties as xgrammar does); `whitespace_pattern`: a JSON guide's whitespace as a regex (llguidance's)
_JSON_OPTIONS = ("backend", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


class VllmSettings:
    """A request's inputs with its vLLM settings (the `sampling_parameters` JSON and the request's own
    parameters) as the inputs they stand for; `field(key)` names where a setting came from, for errors."""

    def __init__(self, lookup: InputLookup, arrays: dict[str, np.ndarray], fields: dict[str, str]):
        self.lookup, self.arrays, self.fields = lookup, arrays, fields

    def __call__(self, name: str) -> np.ndarray | None:
        return self.arrays[name] if name in self.arrays else self.lookup(name)

    def field(self, key: str) -> str:
        return self.fields.get(key, f"input '{tn.SAMPLING_PARAMETERS}': key {key!r}")

    def input_field(self, name: str) -> str:
        """Where input `name` came from: a vLLM setting's key, or the input itself."""
        return self.fields.get(name, f"input '{name}'")


def with_sampling_parameters(lookup: InputLookup, parameters: str | None = None) -> VllmSettings:
    """`lookup`, with vLLM's settings as the inputs they stand for: the keys of a `sampling_parameters` JSON
    and the request's parameters (`parameters`: Triton's JSON of them; vLLM's backend reads its settings
    there too, as its clients send them with tritonclient's `parameters=` and as Triton's HTTP generate
    endpoint passes on keys that name no input). As vLLM's backend does, the parameters are read only when the
    request has no `sampling_parameters`: its sample client sends the same settings both ways."""
    sources = []
    raw = lookup(tn.SAMPLING_PARAMETERS)
    if raw is not None:
        field = f"input '{tn.SAMPLING_PARAMETERS}'"
        if raw.size != 1:
            raise InputError(f"{field} must hold exactly one JSON string, got {raw.size}")
        try:
            text = raw.reshape(-1)[0]
            settings = json_text.parse(text.decode("utf-8") if isinstance(text, bytes) else str(text))
        except ValueError as exc:  # undecodable bytes included
            raise InputError(f"{field} is not valid JSON: {exc}") from None
        if not isinstance(settings, dict):
            raise InputError(f"{field} must be a JSON object, got {type(settings).__name__}")
        sources.append((settings, lambda key: f"{field}: key {key!r}"))
    given = json_text.parse(parameters) if parameters and raw is None else {}  # Triton's JSON of an object
    given = {key: value for key, value in given.items()
             if not key.startswith("triton_") and key not in TRITON_PARAMETERS}
    if given:
        sources.append((given, lambda key: f"request parameter {key!r}"))
    arrays: dict[str, np.ndarray] = {}
    fields: dict[str, str] = {}
    for settings, name_of in sources:  # one of them
        for key, value in settings.items():
            fields[key] = what = name_of(key)
            _read(lookup, arrays, what, key, value)
    return VllmSettings(lookup, arrays, fields)


def _read(lookup: InputLookup, arrays: dict[str, np.ndarray], what: str, key: str, value) -> None:
    """One vLLM setting into `arrays`, as the input(s) it stands for (`what`: its name in errors)."""
    if key in TOKEN_ID_KEYS and value is not None:
        arrays.update(_token_id_setting(what, key, value))
        return
    if key in GUIDED_DECODING_KEYS and value is not None:
        for name in (tn.GUIDED_DECODING_GUIDE_TYPE, tn.GUIDED_DECODING_GUIDE):
            if lookup(name) is not None or name in arrays:
                raise InputError(f"{what} and input '{name}' (or another such key) are one setting; send one of them")
        arrays.update(_guide_setting(what, value))
        return
    if value is None:
        return  # unset
    if key in VLLM_KEYS:
        arrays[key] = _setting(what, value, VLLM_KEYS[key])
        return
    if key in NO_EFFECT_PARAMETERS:
        _setting(what, value, NO_EFFECT_PARAMETERS[key])  # (checked for its type, then read no further)
        return
    if key in NEUTRAL_SAMPLING_PARAMETERS:
        neutral = NEUTRAL_SAMPLING_PARAMETERS[key]
        if _setting(what, value, np.bool_ if isinstance(neutral, bool) else np.int32).item() != neutral:
            raise InputError(f"{what} is supported only at {json.dumps(neutral)}, got {value!r}")
        return  # a setting speculative decoding does not have, at its neutral value
    if key not in SAMPLING_PARAMETER_KEYS:
        raise InputError(f"{what} is not supported (supported: {', '.join(SAMPLING_PARAMETER_KEYS)}, "
                         f"{', '.join(TOKEN_ID_KEYS + tuple(VLLM_KEYS) + GUIDED_DECODING_KEYS)}, "
                         f"{', '.join(NO_EFFECT_PARAMETERS)}; "
                         f"at their neutral values: {', '.join(NEUTRAL_SAMPLING_PARAMETERS)})")
    name, dtype = SAMPLING_PARAMETER_KEYS[key]
    if lookup(name) is not None:
        raise InputError(f"{what} and input '{name}' are one setting; send one of them")
    arrays[name] = _setting(what, value, dtype)
    if key == "top_k" and arrays[name].item() == -1:
        arrays[name] = np.zeros((1, 1), dtype=np.int32)


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
            ids.append(int(token) if isinstance(token, (int, str)) and not isinstance(token, bool) else None)
        except ValueError:
            ids.append(None)
        low, high = INT_RANGES[np.int64]
        if ids[-1] is None or not low <= ids[-1] <= high:
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


def _guide_setting(what: str, value) -> dict[str, np.ndarray]:
    """vLLM's guided_decoding / structured_outputs object (or its JSON) as our two guide inputs."""
    if isinstance(value, str):
        try:
            value = json_text.parse(value)
        except ValueError as exc:
            raise InputError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError(f"{what} must be an object, got {type(value).__name__}")
    guides = {key: v for key, v in value.items() if key in GUIDE_KEYS and v is not None and v is not False}
    for key, v in value.items():
        if key in NEUTRAL_GUIDE_KEYS and v is not None and v != NEUTRAL_GUIDE_KEYS[key]:
            raise InputError(f"{what}: {key!r} is supported only at {NEUTRAL_GUIDE_KEYS[key]!r}, got {v!r}")
        if key not in GUIDE_KEYS and key not in NEUTRAL_GUIDE_KEYS and key not in _JSON_OPTIONS:
            raise InputError(f"{what}: {key!r} is not supported (one of {', '.join(GUIDE_KEYS)})")
    if len(guides) != 1:
        raise InputError(f"{what} must set exactly one of {', '.join(GUIDE_KEYS)}, got {sorted(guides) or 'none'}")
    (key, guide), = guides.items()
    if key == "json_object":
        if guide is not True:
            raise InputError(f"{what}: 'json_object' must be true, got {guide!r}")
        guide = ""
    elif key in ("json", "choice", "structural_tag") and not isinstance(guide, str):
        guide = json.dumps(guide)  # a schema object, a list of choices or the tags, as the guide's JSON text
    elif not isinstance(guide, str):
        raise InputError(f"{what}: {key!r} must be a string, got {type(guide).__name__}")
    compact, closed = value.get("disable_any_whitespace"), value.get("disable_additional_properties")
    for name, flag in (("disable_any_whitespace", compact), ("disable_additional_properties", closed)):
        if flag not in (None, False, True):
            raise InputError(f"{what}: {name!r} must be true or false, got {flag!r}")
    spaces = value.get("whitespace_pattern")
    if spaces is not None:
        if not isinstance(spaces, str):
            raise InputError(f"{what}: 'whitespace_pattern' must be a regex string, got {spaces!r}")
        if compact:
            raise InputError(f"{what}: 'whitespace_pattern' and 'disable_any_whitespace' both say the JSON's "
                             "whitespace; send one")
        if GUIDE_KEYS[key] not in ("json", "json_schema"):
            raise InputError(f"{what}: 'whitespace_pattern' applies to a JSON guide ('json' or 'json_object'), "
                             f"not {key!r}")
    guide_type = GUIDE_KEYS[key]
    if (compact or closed or spaces is not None) and guide_type in ("json", "json_schema"):  # (others say theirs)
        try:
            schema = json_text.parse(guide) if guide else {"type": "object"}
        except ValueError as exc:
            raise InputError(f"{what}: 'json' is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InputError(f"{what}: 'json' must be a JSON schema object")
        schema = _closed(schema) if closed else schema
        if spaces is not None:
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_pattern": spaces}}
        guide_type, guide = "json_schema", json.dumps(_compact(schema) if compact else schema)
    elif compact and guide_type == "structural_tag":  # each structure's JSON compact
        try:
            tags = json_text.parse(guide)
        except ValueError as exc:
            raise InputError(f"{what}: 'structural_tag' is not valid JSON: {exc}") from None
        structures = tags.get("structures") if isinstance(tags, dict) else None
        if isinstance(structures, list):  # (anything else is refused, named, when the guide compiles)
            tags["structures"] = [{**one, "schema": _compact(one.get("schema", {}))}
                                  if isinstance(one, dict) and isinstance(one.get("schema", {}), dict) else one
                                  for one in structures]
        guide = json.dumps(_compact_formats(tags))
    return {tn.GUIDED_DECODING_GUIDE_TYPE: np.array([[guide_type]], dtype=np.object_),
            tn.GUIDED_DECODING_GUIDE: np.array([[guide]], dtype=np.object_)}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
# a subschema, or a list of them
_SCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
            "unevaluatedProperties", "additionalItems", "anyOf", "allOf", "oneOf", "prefixItems")


def _closed(schema):
    """A JSON schema whose objects that leave `additionalProperties` unsaid (a schema of type object, or with
    properties) have it false, at every depth of its subschemas."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
        elif isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if (out.get("type") == "object" or isinstance(out.get("properties"), dict)) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _compact_formats(node):
    """xgrammar's structural tag format tree with each JSON-style json_schema format's JSON compact."""
    if isinstance(node, list):
        return [_compact_formats(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _compact_formats(value) if key not in ("json_schema", "schema") else value
            for key, value in node.items()}
    if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict) and node.get(
            "style", "json") == "json":
        node["json_schema"] = _compact(node["json_schema"])
    return node


def _compact(schema: dict) -> dict:
    """A JSON schema whose JSON has no whitespace between its tokens (llguidance's whitespace_flexible: false)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}}


def _setting(what: str, value, dtype) -> np.ndarray:
    """One JSON setting as the (1, n) array its input would be. Numbers and booleans may come as strings
    (vLLM's backend converts them too). A number the input's type cannot hold is refused by name: numpy
    would raise on it (an integer) or store infinity (a float) after the request was accepted."""
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
    number = _number(value)
    if dtype is np.float32:
        if number is None or not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            raise InputError(f"{what} must be a number, got {value!r}")
        return np.array([[number]], dtype=dtype)
    if number is None or isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        raise InputError(f"{what} must be an integer, got {value!r}")
    low, high = INT_RANGES[dtype]
    if dtype is np.uint64 and number < 0:
        raise InputError(f"{what} must be >= 0, got {value!r}")
    if not low <= int(number) <= high:
        raise InputError(f"{what} must be within [{low}, {high}], got {value!r}")
    return np.array([[int(number)]], dtype=dtype)


def _number(value) -> int | float | None:
    """A JSON number, or a string of one, as Python reads it (an integer stays exact: a 64-bit seed would
    not survive a float); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return None
    return value
