"""trim_heap gives freed heap pages back to the OS (glibc, and TCMalloc where the launcher preloads it)."""

import os
import subprocess
import sys

import pytest

from specdec.engine import host_memory
from specdec.serving import allocator

# 200 MiB in 64 KiB blocks (under glibc's mmap threshold: they live in the heap), all freed but the last,
# which pins the heap's top so that glibc cannot shrink it on its own; RssAnon in KiB before/after trim.
CHURN = """
import sys
from specdec.engine import host_memory
def anon():
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon:')).split()[1])
print(host_memory._tcmalloc_release() is not None)
blocks = [bytearray(64 * 1024) for _ in range(3200)]
keep = blocks[-1]
del blocks
before = anon()
assert host_memory.trim_heap()
print(before, anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory._malloc_trim() is None,
                    reason="glibc's malloc_trim and /proc are Linux-only")
def test_trim_returns_freed_heap_pages():
    released, before, after = churn({})
    assert released == "False"  # glibc's heaps
    assert before - after > 150 * 1024, (before, after)  # KiB: most of the 200 MiB freed comes back


def churn(env: dict[str, str]) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", CHURN], check=True, capture_output=True, text=True,
                         env={**os.environ, **env}).stdout.split()
    return out[0], int(out[1]), int(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not allocator.find_tcmalloc(),
                    reason="no TCMalloc library installed (libtcmalloc-minimal4)")
def test_trim_returns_tcmallocs_free_spans_where_it_is_preloaded():
    env, _ = allocator.environment(allocator.TCMALLOC, on_cpu=True, environ={})
    released, before, after = churn(env)
    assert released == "True"  # TCMalloc's release, not glibc's trim of heaps that hold nothing
    assert before - after > 150 * 1024, (before, after)


def test_a_trim_is_due_once_an_interval_after_memory_was_freed():
    """TrimSchedule: nothing freed, no trim however long; freed, a trim once the interval since the last has
    passed, then none until something is freed again; an interval of 0 never trims."""
    now = [100.0]
    schedule = host_memory.TrimSchedule(30.0, clock=lambda: now[0])
    now[0] += 120
    assert not schedule.due()  # idle: nothing to give back
    schedule.freed()
    assert schedule.due()  # 120 s since the schedule began
    schedule.freed()
    now[0] += 29
    assert not schedule.due()  # within the interval of the last trim
    now[0] += 1
    assert schedule.due() and not schedule.due()  # once, then nothing freed since
    never = host_memory.TrimSchedule(0.0, clock=lambda: now[0])
    never.freed()
    now[0] += 1e6
    assert not never.due()
