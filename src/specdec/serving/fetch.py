"""Download the pair's weights into a volume once (`python -m specdec.serving.fetch`): the chart's init
container, run from the server's own image (no `pip install` at pod start: air-gapped clusters work
through a mirror given by HF_ENDPOINT).

Environment: TARGET_REPO and optionally DRAFT_REPO (Hugging Face repository ids, `id@revision` pins a
revision), MODELS_DIR (default /models; target/ and draft/ go below it), HF_TOKEN (from a Secret) for
gated repositories. The completion marker names the repositories it holds, so changing TARGET_REPO or
DRAFT_REPO downloads again instead of serving the old weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

MARKER = ".complete"


def wanted(target_repo: str, draft_repo: str) -> str:
    """What the marker must say for these repositories (ids with their revisions)."""
    return f"target={target_repo}\ndraft={draft_repo}\n"


def _split(repo: str) -> tuple[str, str | None]:
    repo_id, _, revision = repo.partition("@")
    return repo_id, revision or None


def fetch(models_dir: Path, target_repo: str, draft_repo: str = "", token: str | None = None,
          download: Callable[..., object] | None = None) -> bool:
    """Download what is missing; returns False when the marker already names these repositories."""
    marker = models_dir / MARKER
    expected = wanted(target_repo, draft_repo)
    if marker.exists() and marker.read_text() == expected:
        return False
    if download is None:
        from huggingface_hub import snapshot_download as download
    marker.unlink(missing_ok=True)  # a half-finished or different download is never taken for complete
    for name, repo in (("target", target_repo), ("draft", draft_repo)):
        dest = models_dir / name
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
    if not target:
        print("TARGET_REPO is not set", file=sys.stderr)
        return 2
    models_dir = Path(os.environ.get("MODELS_DIR", "/models"))
    draft = os.environ.get("DRAFT_REPO", "")
    done = fetch(models_dir, target, draft, token=os.environ.get("HF_TOKEN") or None)
    key = hashlib.sha256(wanted(target, draft).encode()).hexdigest()[:12]
    print(f"[specdec] weights {'downloaded' if done else 'already present'} in {models_dir} ({key})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
