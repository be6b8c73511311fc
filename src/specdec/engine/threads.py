"""How many CPU threads a model's forwards run on (`torch_threads`).

torch starts one worker per core of the machine, not per CPU a container was granted: a pod limited to 4
CPUs on a 64-core node runs 32-thread forwards in 4 CPUs' worth of time, and every model stub (draft,
target) does so. `auto` keeps torch's count but no more than the CPUs this process may actually use
(`available_cpus`). Fewer threads than that can pay for a small model, whose steps hardly speed up on a
second thread while it takes a core the other stubs need; that is a count a deployment sets.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>", or "max <period>"


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota where one is set (a
    Kubernetes CPU limit: 2.5 CPUs' worth of time -> 3)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def set_torch_threads(count: int | None) -> int:
    """This process's torch threads: `count`, or with None (`auto`) torch's own count capped by
    `available_cpus()`. Returns the count set."""
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), available_cpus()) if count is None else count)
    return torch.get_num_threads()


def adopt_torch_threads() -> int:
    """Give the calling thread the process's torch thread count for OpenMP's parallel regions too, before it
    runs forwards. torch.set_num_threads sets OpenMP's count for the thread that calls it only: a thread
    Python starts later begins with OpenMP's default (every core, or OMP_NUM_THREADS), which the project's
    own kernels (`#pragma omp parallel`, panel_linear.py) would use there until torch's first parallel
    operator on that thread set it. Returns the count."""
    import torch

    torch.set_num_threads(torch.get_num_threads())
    return torch.get_num_threads()
