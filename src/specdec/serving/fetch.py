"""Download the pair's weights into a volume once (`python -m specdec.serving.fetch`): the chart's init
container, run from the server's own image (no `pip install` at pod start: air-gapped clusters work
through a mirror given by HF_ENDPOINT).

Environment: TARGET_REPO and optionally DRAFT_REPO (Hugging Face repository ids, `id@revision` pins a
revision; TARGET_REPO empty where DRAFT_REPO is a head in the speculators library's layout: its verifier is
fetched as the target, as `vllm serve` takes such a head alone), LORA_REPOS (LoRA adapters,
`NAME=REPO,NAME=REPO`: each into lora/NAME), MODELS_DIR (default /models; target/, draft/ and lora/ go below
it), HF_TOKEN (from a Secret) for gated repositories. The completion marker names the repositories it holds,
so changing any downloads again instead of serving the old weights (an adapter no longer named is removed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from specdec.engine.lora_config import parse_adapters, stays_inside
from specdec.serving.speculative_config import named_verifier, read_config

MARKER = ".complete"
LORA = "lora"  # MODELS_DIR/lora/NAME: the fetched adapters (the chart's lora_adapters point there)


def wanted(target_repo: str, draft_repo: str, lora: dict[str, str] | None = None) -> str:
    """What the marker must say for these repositories (ids with their revisions)."""
    return f"target={target_repo}\ndraft={draft_repo}\n" + "".join(f"{LORA} {name}={repo}\n"
                                                                  for name, repo in sorted((lora or {}).items()))


def _fetched_adapters(marker: Path) -> list[str]:
    """The adapters' names a marker lists (what an earlier fetch put under lora/)."""
    lines = marker.read_text().splitlines() if marker.exists() else []
    return [line[len(LORA) + 1:].split("=", 1)[0] for line in lines if line.startswith(LORA + " ")]


def _split(repo: str) -> tuple[str, str | None]:
    repo_id, _, revision = repo.partition("@")
    return repo_id, revision or None


def fetch(models_dir: Path, target_repo: str, draft_repo: str = "", token: str | None = None,
          download: Callable[..., object] | None = None, lora: dict[str, str] | None = None) -> bool:
    """Download what is missing (the target, the draft, and `lora`'s adapters {name: repo} into lora/NAME);
    returns False when the marker already names these repositories."""
    marker = models_dir / MARKER
    lora = lora or {}
    for name in lora:
        if not stays_inside(name):
            raise ValueError(f"LORA_REPOS: adapter name {name!r} would leave {models_dir / LORA}")
    expected = wanted(target_repo, draft_repo, lora)
    if marker.exists() and marker.read_text() == expected:
        return False
    if download is None:
        from huggingface_hub import snapshot_download as download
    for gone in set(_fetched_adapters(marker)) - set(lora):
        shutil.rmtree(models_dir / LORA / gone, ignore_errors=True)
    marker.unlink(missing_ok=True)  # a half-finished or different download is never taken for complete
    # no target named: the draft first, a head that names its verifier (checked below)
    wanted_dirs = [("target", target_repo), ("draft", draft_repo)] if target_repo else [("draft", draft_repo),
                                                                                      ("target", None)]
    wanted_dirs += [(f"{LORA}/{name}", repo) for name, repo in sorted(lora.items())]
    for name, repo in wanted_dirs:
        dest = models_dir / name
        if repo is None:
            repo = named_verifier(read_config(models_dir / "draft"))
            if not repo:
                raise ValueError(f"TARGET_REPO is not set and DRAFT_REPO {draft_repo or '(none)'} names no verifier "
                                 "(a head in the speculators library's layout names the model it drafts for)")
        if not repo:
            shutil.rmtree(dest, ignore_errors=True)
            continue
        repo_id, revision = _split(repo)
        print(f"[specdec] downloading {repo_id}{'@' + revision if revision else ''} to {dest}", flush=True)
        download(repo_id, revision=revision, local_dir=dest, token=token)
    marker.write_text(expected)
    return True


def main() -> int:
    target = os.environ.get("TARGET_REPO", "")
    draft = os.environ.get("DRAFT_REPO", "")
    if not target and not draft:
        print("TARGET_REPO is not set", file=sys.stderr)
        return 2
    models_dir = Path(os.environ.get("MODELS_DIR", "/models"))
    try:
        lora = parse_adapters(os.environ.get("LORA_REPOS", ""), "LORA_REPOS")
        done = fetch(models_dir, target, draft, token=os.environ.get("HF_TOKEN") or None, lora=lora)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    key = hashlib.sha256(wanted(target, draft, lora).encode()).hexdigest()[:12]
    print(f"[specdec] weights {'downloaded' if done else 'already present'} in {models_dir} ({key})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
