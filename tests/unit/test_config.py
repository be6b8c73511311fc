"""Config validation at load: every error names the parameter."""

import json

import pytest

from specdec.engine.loading import load_causal_lm
from specdec.triton.config import ConfigError, ModelParameters


def params(**values):
    return ModelParameters(json.dumps({"name": "target_model",
                                       "parameters": {k: {"string_value": v} for k, v in values.items()}}))


def test_required_parameter_missing():
    with pytest.raises(ConfigError, match="target_model: parameter 'model_path' is required"):
        params().str("model_path")


@pytest.mark.parametrize("call, message", [
    (lambda p: p.int("max_sequences", 1, low=1), "'max_sequences' must be an integer"),
    (lambda p: p.float("sequence_idle_timeout_s", 1.0), "'sequence_idle_timeout_s' must be a number"),
    (lambda p: p.bool("apply_chat_template", False), "'apply_chat_template' must be true or false"),
    (lambda p: p.str("dtype", "float32", choices=("float32",)), "'dtype' must be one of"),
])
def test_malformed_values_name_the_parameter(call, message):
    p = params(max_sequences="many", sequence_idle_timeout_s="soon", apply_chat_template="maybe", dtype="int4")
    with pytest.raises(ConfigError, match=message):
        call(p)


def test_range_checked():
    with pytest.raises(ConfigError, match=r"'max_num_draft_tokens' must be within \[0, 64\], got 99"):
        params(max_num_draft_tokens="99").int("max_num_draft_tokens", 4, low=0, high=64)


def test_defaults_and_lists():
    p = params(draft_models=" draft_model , draft_b ,")
    assert p.list("draft_models") == ["draft_model", "draft_b"]
    assert p.int("absent", 7) == 7 and p.bool("absent", True) is True


def test_a_count_or_auto():
    assert params(torch_threads="auto").count_or_auto("torch_threads", "1") is None
    assert params().count_or_auto("torch_threads", "auto") is None
    assert params().count_or_auto("torch_threads", "1") == 1
    assert params(torch_threads="3").count_or_auto("torch_threads", "auto") == 3
    with pytest.raises(ConfigError, match=r"'torch_threads' must be within \[1, None\], got 0"):
        params(torch_threads="0").count_or_auto("torch_threads", "auto")


def test_model_path_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_path '/no/such/dir' does not exist"):
        load_causal_lm("/no/such/dir")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_causal_lm(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_causal_lm(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_causal_lm(str(tmp_path), dtype="int3")
