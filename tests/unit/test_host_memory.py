"""trim_heap gives freed heap pages back to the OS (glibc)."""

import subprocess
import sys

import pytest

from specdec.engine import host_memory

# 200 MiB in 64 KiB blocks (under glibc's mmap threshold: they live in the heap), all freed but the last,
# which pins the heap's top so that glibc cannot shrink it on its own; RssAnon in KiB before/after trim.
CHURN = """
import sys
from specdec.engine import host_memory
def anon():
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon:')).split()[1])
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
    before, after = map(int, subprocess.run([sys.executable, "-c", CHURN], check=True, capture_output=True,
                                            text=True).stdout.split())
    assert before - after > 150 * 1024, (before, after)  # KiB: most of the 200 MiB freed comes back
