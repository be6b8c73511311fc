"""Render `model_repository/` for a chosen pair: copy it and set the config.pbtxt parameters.

The committed configs are valid Triton configs (paths default to /models/... as in the image); this
rewrites only `parameters` values and instance kinds, and adds one draft_model copy per extra draft.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from specdec.pairs import REPO_ROOT, PairSpec

SOURCE = REPO_ROOT / "model_repository"


def set_parameter(config: str, key: str, value: str) -> str:
    """Set parameters { key: "<key>" ... } to value, adding the entry if absent."""
    pattern = re.compile(r'(parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*,?\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    if pattern.search(config):
        return pattern.sub(lambda m: m.group(1) + escaped + m.group(2), config)
    return config.rstrip("\n") + f'\nparameters {{ key: "{key}", value: {{ string_value: "{escaped}" }} }}\n'


def render(pair: PairSpec, dest: Path, instance_kind: str = "KIND_CPU") -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SOURCE, dest, ignore=shutil.ignore_patterns("__pycache__"))

    def edit(model: str, settings: dict[str, str]) -> None:
        path = dest / model / "config.pbtxt"
        text = path.read_text()
        for key, value in settings.items():
            text = set_parameter(text, key, value)
        text = re.sub(r"kind:\s*KIND_\w+", f"kind: {instance_kind}", text)
        path.write_text(text)

    tokenizer = {"tokenizer_path": pair.tokenizer_path}
    edit("preprocessing", {**tokenizer, "apply_chat_template": str(pair.apply_chat_template).lower()})
    edit("postprocessing", tokenizer)
    edit("target_model", {"model_path": pair.target_path, "dtype": pair.dtype})
    drafts = list(pair.draft_paths.items())
    for name, _ in drafts[1:]:
        shutil.copytree(dest / "draft_model", dest / name)
        cfg = dest / name / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace('name: "draft_model"', f'name: "{name}"'))
    for name, path in drafts:
        edit(name, {"model_path": path, "dtype": pair.dtype})
    draft_models = [name for name, _ in drafts] + list(pair.builtin_drafts)
    if pair.default_draft:  # the first entry is the default
        draft_models.remove(pair.default_draft)
        draft_models.insert(0, pair.default_draft)
    edit("speculative_decoding", {**tokenizer, "draft_models": ",".join(draft_models),
                                  "max_context_tokens": str(pair.max_context_tokens)})
    return dest
