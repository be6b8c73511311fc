"""CUDA MPS for one server: a control daemon of the launcher's own, started before tritonserver and told to
quit after it.

draft_model and target_model run in two stub processes, two CUDA contexts, and without MPS one GPU
time-slices between them: under concurrent speculative streams each model's forwards also wait out the
other's kernels. Under MPS both processes' kernels go through one server and run side by side. The daemon gets pipe and log directories of its own, new
for each launch in the local temporary directory (NVIDIA: the pipes must be local and not shared between
nodes; a run directory may sit on a shared volume), and the server's processes are pointed at them: it
neither meets nor disturbs a daemon the host runs with the default /tmp/nvidia-mps, nor one left behind by
a launcher that was killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    pass


class MpsDaemon:
    def __init__(self, directory: Path | None = None, control: str = CONTROL):
        """directory: where its pipes and logs go; default a new one in the temporary directory, removed at stop."""
        self.owned = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="specdec-mps-")) if directory is None else Path(directory)
        self.control = control
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.directory / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "log")}
        self.started = False

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.control, *args], input=stdin, env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        """Start the daemon (it forks into the background and returns); MpsError says why it could not."""
        if shutil.which(self.control) is None:
            raise MpsError(f"--mps: {self.control} not found on PATH (it comes with the NVIDIA driver; in a "
                           "container the NVIDIA container toolkit mounts it with the compute capability)")
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        done = self._run(["-d"])
        if done.returncode != 0:
            log = Path(self.env["CUDA_MPS_LOG_DIRECTORY"], "control.log")
            detail = (done.stderr or done.stdout).strip() or (log.read_text(errors="replace")[-500:] if log.exists() else "")
            raise MpsError(f"--mps: {self.control} -d exited with {done.returncode}: {detail}")
        self.started = True

    def stop(self) -> None:
        """Tell the daemon to quit (after the server's processes, its clients, are gone)."""
        if self.started:
            self._run([], stdin="quit\n")
            self.started = False
        if self.owned:
            shutil.rmtree(self.directory, ignore_errors=True)
