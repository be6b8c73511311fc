"""LoRA adapter lists as model configs and command lines spell them (no torch: the launcher and the
orchestrator read them too; the adapters themselves are engine/lora.py's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # what an adapter may be named (and a request name)
CONFIG = "adapter_config.json"  # what makes a directory a (PEFT) adapter
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # its weights, the first found read


def parse_adapters(text: str, field: str) -> dict[str, str]:
    """{name: path} from a config value: a JSON object, or "name=path,name=path" (vLLM's --lora-modules
    spelling); ValueError naming `field`."""
    text = (text or "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{field}: not JSON ({error})") from None
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"{field}: a JSON object of name to directory, got {text!r}")
        pairs = list(value.items())
    else:
        pairs = []
        for item in text.split(","):
            name, sep, path = item.strip().partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"{field}: NAME=DIRECTORY pairs separated by commas, got {item.strip()!r}")
            pairs.append((name.strip(), path.strip()))
    out: dict[str, str] = {}
    for name, path in pairs:
        if not NAME.match(name):
            raise ValueError(f"{field}: adapter name {name!r}: letters, digits and . _ : / - (at most 128)")
        if name in out:
            raise ValueError(f"{field}: adapter {name!r} named twice")
        out[name] = path
    return out


DIRECTORY_SLOTS = 4  # adapters of a directory held at once beside the named ones, where max_loras does not say


def slot_count(max_loras: int, named: int, directory: str) -> int:
    """How many adapters the target holds at once (max_loras; 0: the `named` ones and DIRECTORY_SLOTS more with a
    directory): what vLLM's max_loras reports."""
    return max_loras or named + (DIRECTORY_SLOTS if directory else 0)


def format_adapters(adapters: dict[str, str]) -> str:
    """{name: path} as a config value ("name=path,name=path"); ValueError for a path that spelling cannot hold."""
    for name, path in adapters.items():
        if not NAME.match(name):
            raise ValueError(f"LoRA adapter name {name!r}: letters, digits and . _ : / - (at most 128)")
        if "," in path or '"' in path or not path.strip():
            raise ValueError(f"LoRA adapter {name!r}: its directory {path!r} may not hold a comma or a quote")
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def stays_inside(name: str) -> bool:
    """Whether `name` is an adapter's name that keeps DIRECTORY/NAME inside DIRECTORY (no `..`, `.` or empty
    part), what a directory of adapters (and the fetched adapters' folder) may hold."""
    return bool(NAME.match(name)) and not any(part in ("", ".", "..") for part in name.split("/"))


def directory_adapter(directory: str | Path, name: str) -> Path | None:
    """The adapter `name` in a directory of adapters (lora_directory: DIRECTORY/NAME, PEFT's layout; a name
    with a slash, an owner's: DIRECTORY/OWNER/NAME), or None: no such adapter, or a name that could leave the
    directory (`..`, `.`, an empty part)."""
    if not directory or not stays_inside(name):
        return None
    path = Path(directory, *name.split("/"))
    return path if (path / CONFIG).is_file() else None


def directory_adapters(directory: str | Path) -> list[str]:
    """The names of the adapters in a directory of adapters (one level down, or two for OWNER/NAME), sorted."""
    root = Path(directory) if directory else None
    if root is None or not root.is_dir():
        return []
    names = []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        if (path / CONFIG).is_file():
            names.append(path.name)
        else:
            names.extend(f"{path.name}/{inner.name}" for inner in sorted(path.iterdir())
                         if inner.is_dir() and (inner / CONFIG).is_file())
    return [name for name in names if directory_adapter(root, name) is not None]


FIRST_LAYERS = "first"  # a draft's lora_layers: its layers are the target's first ones (a layer-skip draft model)


def parse_layer_map(text: str, layers: int, field: str) -> tuple[int, ...] | None:
    """A draft model's `lora_layers`: the target's layer each of its `layers` layers is ("first": the
    target's first `layers`; or a list like "0-9" or "0,1,2,28,29"), so that it runs the target's adapters
    on them; "" = None (it runs no adapter). ValueError naming `field`."""
    text = (text or "").strip()
    if not text:
        return None
    if text == FIRST_LAYERS:
        return tuple(range(layers))
    out: list[int] = []
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            out += list(range(int(low), int(high) + 1)) if sep else [int(low)]
        except ValueError:
            raise ValueError(f"{field}: {part.strip()!r} is not a layer or a range of layers (like 0-9)") from None
    if len(out) != layers or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"{field}: {text!r} names {len(out)} layers (distinct, >= 0); the model has {layers}")
    return tuple(out)
