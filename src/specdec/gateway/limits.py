"""The open-files limit of the API's process (and, raised by the launcher, of tritonserver's): every client
connection holds a file descriptor, and once the soft limit (1024 on many hosts) is reached the API stops
answering and its log fills with "Too many open files" (measured: docs/results/2026-12-06-stream-ends-and-orphans.md).
As vLLM does, the soft limit is raised towards the hard one at start (a process may, unprivileged)."""

from __future__ import annotations

import resource

OPEN_FILES = 65535  # vLLM's target


def raise_open_files(target: int = OPEN_FILES) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to `target` (at most the hard limit; never lowered); (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return soft, want
    return soft, soft
