"""torch_threads=auto: the CPUs a process may use, its affinity capped by a container's CPU limit; a thread
started later runs OpenMP on the process's count once it adopts it."""

import ctypes
import os
import threading

import pytest
import torch

from specdec.engine.threads import adopt_torch_threads, available_cpus, set_torch_threads


def test_available_cpus_follow_the_affinity_and_a_cgroup_quota(tmp_path):
    granted = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert available_cpus(tmp_path / "missing") == granted
    cpu_max.write_text("max 100000\n")
    assert available_cpus(cpu_max) == granted
    cpu_max.write_text("50000 100000\n")  # half a CPU's time: one thread
    assert available_cpus(cpu_max) == 1
    cpu_max.write_text(f"{granted * 300000} 100000\n")  # a quota above the affinity: the affinity
    assert available_cpus(cpu_max) == granted


def test_set_torch_threads_takes_a_count_or_caps_torchs_own_by_the_cpus_granted():
    before = torch.get_num_threads()
    try:
        assert set_torch_threads(1) == 1 == torch.get_num_threads()
        torch.set_num_threads(64)
        assert set_torch_threads(None) == min(64, available_cpus())
    finally:
        torch.set_num_threads(before)


def _openmp_threads() -> int:
    """OpenMP's thread count for the calling thread's parallel regions (the runtime torch loaded)."""
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libgomp" in line]
    if not paths:
        pytest.skip("torch runs no libgomp here")
    return ctypes.CDLL(paths[0]).omp_get_max_threads()


def test_a_thread_started_later_adopts_the_processs_count_for_openmp():
    before = torch.get_num_threads()
    seen = {}

    def run(adopt: bool) -> None:
        if adopt:
            adopt_torch_threads()
        seen[adopt] = _openmp_threads()
    try:
        torch.set_num_threads(1)
        for adopt in (False, True):
            thread = threading.Thread(target=run, args=(adopt,))
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(before)
    if seen[False] == 1:
        pytest.skip("OpenMP's default here is one thread already: nothing to adopt")
    assert seen[True] == 1  # not OpenMP's default for a new thread (every core)
