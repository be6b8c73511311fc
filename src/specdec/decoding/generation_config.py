"""A model's `generation_config.json`: the tokens that end its answers, and its makers' sampling defaults.

transformers' `generate()` and vLLM stop at every `eos_token_id` the file names, not only the tokenizer's
end token: Llama-3.1-Instruct ends a turn with `<|eot_id|>` and a built-in tool call with `<|eom_id|>`
(file: [128001, 128008, 128009]); Qwen2.5 and Qwen3 name `<|im_end|>` and `<|endoftext|>`. The orchestrator
ends every request at these (unless the request names its own end id, or says `ignore_eos`).

vLLM also takes the file's sampling fields as the OpenAI API's defaults for a request that omits them
(`--generation-config auto`, its default; `vllm`: its own defaults; `--override-generation-config` merged
over either): Qwen3 then samples at temperature 0.6, top_p 0.95, top_k 20 unless asked otherwise, as its
makers recommend. The same keys are read here, with the same names on the wire (max_new_tokens becomes
max_tokens). The Triton APIs keep their documented defaults (greedy), as vLLM's and TensorRT-LLM's Triton
backends do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FILE = "generation_config.json"
AUTO, VLLM = "auto", "vllm"  # --generation-config's words; anything else names a directory

# The file's sampling keys vLLM takes as defaults -> the request field each stands for (its value's check)
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read(path: str, field: str) -> dict:
    """The generation config at `path` (a model directory holding generation_config.json, or the file itself);
    {} for "" or a directory (or GGUF file) without one, as models without the file have no settings of it.
    ValueError naming `field` and the file when it is no JSON object."""
    if not path:
        return {}
    p = Path(path)
    file = p / FILE if p.is_dir() else p if p.suffix == ".json" else None
    if file is None or not file.is_file():
        if p.suffix == ".json" or not p.exists():  # a file or directory named that is not there: a mistake
            raise ValueError(f"{field}: {path!r} is neither a model directory nor a {FILE}")
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{field}: cannot read {str(file)!r} ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{field}: {str(file)!r} is no JSON object")
    return config


def end_ids(config: dict, vocab_size: int, field: str) -> frozenset[int]:
    """The token ids the config's `eos_token_id` names (a number or a list; none when absent), each checked to be
    within the vocabulary (ValueError naming `field` otherwise)."""
    value = config.get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    for token in values:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"{field}: eos_token_id {value!r} is not token ids within [0, {vocab_size})")
    return frozenset(values)


def sampling_defaults(config: dict, override: dict, field: str, override_field: str) -> dict:
    """The request fields (OpenAI/vLLM names) a config's sampling keys give defaults to: the config's keys with
    `override` (vLLM's --override-generation-config, the same key names) merged over them; a key the override
    sets to null is no default. ValueError naming `field` (a key of the config) or `override_field` for a
    value no request could send, or an override key that is no sampling key."""
    unknown = sorted(set(override) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"{override_field}: {unknown[0]!r} is no sampling default "
                         f"(known: {', '.join(SAMPLING_KEYS)})")
    merged = {**{key: (config[key], field) for key in SAMPLING_KEYS if config.get(key) is not None},
              **{key: (value, override_field) for key, value in override.items()}}
    defaults = {}
    for key, (value, named) in merged.items():
        if value is None:
            continue
        _check(key, value, named)
        defaults[SAMPLING_KEYS[key]] = value
    return defaults


def api_defaults(choice: str, model: str, override: str) -> dict:
    """The OpenAI API's sampling defaults for `--generation-config CHOICE` (AUTO: the config of `model`, a
    directory or file; VLLM: none of the model's; else the directory or file CHOICE names) and
    `--override-generation-config OVERRIDE` (JSON; "" for none). ValueError naming the flag otherwise."""
    config = {} if choice == VLLM else read(model if choice == AUTO else choice, "--generation-config")
    return sampling_defaults(config, parse_override(override, "--override-generation-config"),
                             "--generation-config", "--override-generation-config")


def _check(key: str, value, field: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    whole = number and isinstance(value, int)
    valid = {"temperature": number and value >= 0, "top_p": number and 0 < value <= 1,
             "top_k": whole and value >= -1, "min_p": number and 0 <= value <= 1,
             "repetition_penalty": number and value > 0, "max_new_tokens": whole and value >= 1}[key]
    if not valid:
        raise ValueError(f"{field}: {key} {value!r} is out of range")


def parse_override(text: str, field: str) -> dict:
    """--override-generation-config's JSON object (ValueError naming `field` otherwise)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: must be a JSON object, got {text!r}")
    return value
