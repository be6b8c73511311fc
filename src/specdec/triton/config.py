"""Typed access to `config.pbtxt` parameters, validated at model load.

Every error names the parameter, so a wrong path or value fails `initialize` with a message a user can
act on instead of failing at the first request.
"""

from __future__ import annotations

import json


class ConfigError(ValueError):
    pass


class ModelParameters:
    def __init__(self, model_config: dict | str):
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self.model_name = config.get("name", "?")
        self.values = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}

    def _fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.model_name}: parameter '{key}' {problem}")

    def str(self, key: str, default: str | None = None, choices: tuple[str, ...] | None = None) -> str:
        value = self.values.get(key, "")
        if value == "":
            if default is None:
                raise self._fail(key, "is required")
            value = default
        if choices is not None and value not in choices:
            raise self._fail(key, f"must be one of {list(choices)}, got {value!r}")
        return value

    def int(self, key: str, default: int, low: int | None = None, high: int | None = None) -> int:
        raw = self.values.get(key, "")
        try:
            value = default if raw == "" else int(raw)
        except ValueError:
            raise self._fail(key, f"must be an integer, got {raw!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise self._fail(key, f"must be within [{low}, {high}], got {value}")
        return value

    def float(self, key: str, default: float, low: float | None = None, high: float | None = None) -> float:
        raw = self.values.get(key, "")
        try:
            value = default if raw == "" else float(raw)
        except ValueError:
            raise self._fail(key, f"must be a number, got {raw!r}") from None
        if low is not None and value < low:
            raise self._fail(key, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise self._fail(key, f"must be <= {high}, got {value}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        raw = self.values.get(key, "").strip().lower()
        if raw == "":
            return default
        if raw in ("true", "1", "yes"):
            return True
        if raw in ("false", "0", "no"):
            return False
        raise self._fail(key, f"must be true or false, got {raw!r}")

    def list(self, key: str, default: str = "") -> list[str]:
        return [item.strip() for item in self.str(key, default).split(",") if item.strip()]

    def count_or_auto(self, key: str, default: str) -> int | None:
        """A count >= 1, or None for `auto` (e.g. torch_threads: engine/threads.set_torch_threads)."""
        if self.str(key, default) == "auto":
            return None
        return self.int(key, 1, low=1)
