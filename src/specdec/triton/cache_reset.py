"""A client's reset of the server's caches across requests (SGLang's `/flush_cache`, vLLM's
`/reset_prefix_cache`: a benchmark that starts cold, runs comparable to each other): the prefix caches of
target_model and of every draft model (KV blocks kept for later prompts, with a trained head's features) and
the orchestrators' suffix caches (earlier requests' tokens, which the `suffix` draft continues).

Each of those lives in one model instance's process, and Triton has no way to address an instance: the reset
is a marker file instead (marker_file.py), named by ENV in the environment of tritonserver (so of every stub)
and of the OpenAI API, both set by the launcher. The API writes a new file in its place (`request`); each
instance looks (`marker_file.Watch.due`, one stat) before its next work: target and draft models at each
execute, orchestrators as each request arrives. Every request that arrives once the reset is
answered so finds the caches empty. Requests running across it keep what they hold (their KV blocks stay
theirs) and may key blocks and add their text again as they go on.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from specdec.triton import marker_file

ENV = "SPECDEC_CACHE_RESET_FILE"  # the marker's path ("" or unset: no reset)


def marker(http_port: int) -> Path:
    """The marker the launcher names for the server on http_port (one per server on a machine)."""
    return Path(tempfile.gettempdir()) / f"specdec-cache-reset-{http_port}"


def path_from_env() -> str:
    return os.environ.get(ENV, "")


def request(path: str) -> None:
    """Ask every model instance for a reset: a new marker in place (OSError if it cannot be written)."""
    marker_file.replace(path, "reset\n")
