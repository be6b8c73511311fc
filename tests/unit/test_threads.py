"""torch_threads=auto: the CPUs a process may use, its affinity capped by a container's CPU limit."""

import os

import torch

from specdec.engine.threads import available_cpus, set_torch_threads


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
