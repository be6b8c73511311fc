"""A client's reset of the server's caches across requests (SGLang's `/flush_cache`, vLLM's
`/reset_prefix_cache`: a benchmark that starts cold, runs comparable to each other): the prefix caches of
target_model and of every draft model (KV blocks kept for later prompts, with a trained head's features) and
the orchestrators' suffix caches (earlier requests' tokens, which the `suffix` draft continues).

Each of those lives in one model instance's process, and Triton has no way to address an instance: the reset
is a marker file instead, named by ENV in the environment of tritonserver (so of every stub) and of the
OpenAI API, both set by the launcher. The API writes a new file in its place (`request`); each instance
compares what it finds with what it last saw (`Watch.due`, one stat) before its next work: target and draft
models at each execute, orchestrators as each request arrives. Every request that arrives once the reset is
answered so finds the caches empty. Requests running across it keep what they hold (their KV blocks stay
theirs) and may key blocks and add their text again as they go on.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

ENV = "SPECDEC_CACHE_RESET_FILE"  # the marker's path ("" or unset: no reset)


def marker(http_port: int) -> Path:
    """The marker the launcher names for the server on http_port (one per server on a machine)."""
    return Path(tempfile.gettempdir()) / f"specdec-cache-reset-{http_port}"


def path_from_env() -> str:
    return os.environ.get(ENV, "")


class Watch:
    """One process's view of the marker at `path` ("": never due)."""

    def __init__(self, path: str):
        self.path = path
        self.seen = self._state()  # a marker from before this process started is no reset of its caches

    def _state(self) -> tuple[int, int] | None:
        if not self.path:
            return None
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        # A new file each reset: another inode, and a time set to the nanosecond (`request`), where the
        # file system's own clock may tick only every few milliseconds
        return found.st_ino, found.st_mtime_ns

    def due(self) -> bool:
        """Whether a reset was asked for since the last call (or since this process started)."""
        state = self._state()
        if state == self.seen:
            return False
        self.seen = state
        return state is not None  # a marker removed asks for nothing


def request(path: str) -> None:
    """Ask every model instance for a reset: a new marker renamed into place (OSError if it cannot be written)."""
    target = Path(path)
    scratch = target.with_name(f".{target.name}.{os.getpid()}")
    scratch.write_text("reset\n")
    now = time.time_ns()
    os.utime(scratch, ns=(now, now))
    os.replace(scratch, target)
