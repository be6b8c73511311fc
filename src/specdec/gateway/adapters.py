"""vLLM's runtime LoRA endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, over the target's
directory of adapters (lora_directory): an adapter loaded is a link DIRECTORY/NAME to its path, which the target
reads on demand like any of the directory's (engine/lora.py) and the orchestrator admits; unloaded, the link is
gone. Being files, they outlast a restart, and replicas that mount the same directory serve them all.

Off unless `--allow-runtime-lora-updating` (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): whoever may call
them has the server read any directory it can.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from specdec.engine.lora_config import CONFIG, WEIGHTS, directory_adapter, stays_inside
from specdec.gateway.protocol import ApiError, Served, invalid

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, read as vLLM reads it
LOADED = "Success: LoRA adapter '{}' added successfully."  # vLLM's answers (plain text), word for word
UNLOADED = "Success: LoRA adapter '{}' removed successfully."


def allowed_by_environment(environ=os.environ) -> bool:
    return environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoadRequest:
    name: str
    path: Path  # absolute
    inplace: bool  # replace an adapter loaded under the name (vLLM's load_inplace)


def _name(body: dict) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise invalid("lora_name", "must be a non-empty string")
    if not stays_inside(name):
        raise invalid("lora_name", f"{name!r}: letters, digits and . _ : / - (at most 128), no empty, '.' or '..' "
                                   "part")
    return name


def _body(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


class RuntimeAdapters:
    """Adapters loaded and unloaded at run time as links in `served.directory`."""

    def __init__(self, served: Served):
        if not served.directory:
            raise ValueError("runtime LoRA updating needs --lora-directory (the adapters it loads are links there)")
        self.served, self.directory = served, Path(served.directory)

    def load_request(self, body) -> LoadRequest:
        """A load_lora_adapter body checked (ApiError naming the field)."""
        body = _body(body)
        name = _name(body)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise invalid("lora_path", "must be a non-empty string (a directory of PEFT's layout the server reads)")
        inplace = body.get("load_inplace", False)
        if not isinstance(inplace, bool):
            raise invalid("load_inplace", "must be a boolean")
        where = Path(path).resolve()
        if not (where / CONFIG).is_file():
            raise invalid("lora_path", f"{path}: no {CONFIG} there (a PEFT LoRA adapter's directory)")
        if not any((where / weights).is_file() for weights in WEIGHTS):
            raise invalid("lora_path", f"{path}: no {' or '.join(WEIGHTS)} there")
        self._not_launched(name)
        return LoadRequest(name, where, inplace)

    def unload_request(self, body) -> str:
        name = _name(_body(body))
        self._not_launched(name)
        return name

    def _not_launched(self, name: str) -> None:
        if tuple.__contains__(self.served, name):
            kind = "a LoRA adapter served for good (--lora-modules)" if name in self.served.adapters else "the base model"
            raise invalid("lora_name", f"{name!r} is {kind}")

    def _entry(self, name: str) -> Path:
        return self.directory.joinpath(*name.split("/"))

    def link(self, request: LoadRequest) -> str | None:
        """DIRECTORY/NAME made a link to the adapter's path; returns what it linked to before (load_inplace), or
        None. ApiError: loaded already (without load_inplace), or a directory of lora_directory's own."""
        entry = self._entry(request.name)
        if entry.is_symlink():
            if not request.inplace:
                raise ApiError(400, f"The lora adapter '{request.name}' has already been loaded (load_inplace: true "
                                    "replaces it).", param="lora_name")
            before = os.readlink(entry)
            self._replace(entry, request.path)
            return before
        if entry.exists() or directory_adapter(self.directory, request.name) is not None:
            raise ApiError(400, f"The lora adapter '{request.name}' is a directory of lora_directory {self.directory}, "
                                "not one load_lora_adapter added: remove or replace it there", param="lora_name")
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            entry.symlink_to(request.path, target_is_directory=True)
        except FileExistsError:  # another call took the name first
            raise ApiError(400, f"The lora adapter '{request.name}' has already been loaded.",
                           param="lora_name") from None
        except OSError as exc:
            raise ApiError(500, f"lora_directory {self.directory}: cannot add {request.name!r} there ({exc}); the "
                                "API's process must be able to write it") from None
        return None

    def restore(self, request: LoadRequest, before: str | None) -> None:
        """Undo `link` (the adapter did not load): the earlier link back, or none."""
        entry = self._entry(request.name)
        if before is not None:
            self._replace(entry, Path(before))
        elif entry.is_symlink() and Path(os.readlink(entry)) == request.path:
            self._remove(entry, request.name)

    def unlink(self, name: str) -> None:
        """DIRECTORY/NAME's link removed. ApiError: none (404), or a directory of lora_directory's own."""
        entry = self._entry(name)
        if not entry.is_symlink():
            if entry.exists():
                raise ApiError(400, f"The lora adapter '{name}' is a directory of lora_directory {self.directory}, not "
                                    "one load_lora_adapter added: remove it there", param="lora_name")
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        self._remove(entry, name)

    def _remove(self, entry: Path, name: str) -> None:
        try:
            entry.unlink()
        except FileNotFoundError:  # another call removed it first
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        if entry.parent != self.directory:  # an owner's folder this made: gone with its last adapter
            try:
                entry.parent.rmdir()
            except OSError:
                pass

    @staticmethod
    def _replace(entry: Path, target: Path) -> None:
        """The link at `entry` pointed at `target` at once (a new link renamed over it: never missing)."""
        staged = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}.tmp")
        staged.symlink_to(target, target_is_directory=True)
        os.replace(staged, entry)
