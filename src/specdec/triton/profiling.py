"""cProfile over a model's `execute` calls: where a served execution's host time goes, read on the machine
that serves (a GPU host's stub, where the adapter's share of an execution was measured but not its parts).

Off unless SPECDEC_PROFILE_DIR names a directory: the launcher's environment reaches every stub, and each
stub of draft_model and target_model then profiles its `execute` calls on the thread that runs them and
writes the statistics to DIR/<model>-<pid>.prof every few seconds and when it stops (`python -m pstats`,
snakeviz). cProfile slows Python-heavy code, so a profiled server's figures are not its speed: read the
shares, not the times.
"""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path

ENV = "SPECDEC_PROFILE_DIR"


class ExecuteProfile:
    """A context manager around each execute: profiling on inside it, the file rewritten at most every
    interval_s (cumulative since load)."""

    def __init__(self, directory: str | Path, name: str, interval_s: float = 5.0):
        self.path = Path(directory) / f"{name}-{os.getpid()}.prof"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profile = cProfile.Profile()
        self.interval_s = interval_s
        self.executions = 0
        self._written = time.monotonic()

    def __enter__(self) -> "ExecuteProfile":
        self.executions += 1
        self.profile.enable()
        return self

    def __exit__(self, *exc) -> None:
        self.profile.disable()
        if time.monotonic() - self._written >= self.interval_s:
            self.write()

    def write(self) -> None:
        """The statistics so far (none before the first execute: pstats cannot read an empty profile)."""
        if not self.executions:
            return
        self.profile.dump_stats(str(self.path))
        self._written = time.monotonic()


def execute_profile(name: str) -> ExecuteProfile | None:
    """The model's profile when SPECDEC_PROFILE_DIR is set, else None (nothing runs per execute)."""
    directory = os.environ.get(ENV)
    return ExecuteProfile(directory, name) if directory else None


def report(directory: str | Path, top: int = 30) -> str:
    """Each profile in `directory`, its functions by own time and by cumulative time (pstats' text)."""
    import io
    import pstats

    out = io.StringIO()
    for path in sorted(Path(directory).glob("*.prof")):
        for order in ("tottime", "cumulative"):
            out.write(f"## {path.name}, by {order}\n\n")
            pstats.Stats(str(path), stream=out).strip_dirs().sort_stats(order).print_stats(top)
    return out.getvalue()


if __name__ == "__main__":  # python -m specdec.triton.profiling DIR: the report of a profiled server's files
    import sys

    print(report(sys.argv[1]))
