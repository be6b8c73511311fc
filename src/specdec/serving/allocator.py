"""The C allocator tritonserver and its stubs run with (`--allocator`): TCMalloc for CPU models where the
machine has it, glibc's malloc otherwise.

A CPU forward allocates and frees activations of up to tens of megabytes per layer. glibc's malloc serves a
block above its mmap threshold with a fresh mapping each time, whose pages the kernel faults in and zeroes on
first touch, and gives it back at the free; TCMalloc keeps such spans for the next forward. vLLM's CPU
documentation recommends preloading it for that reason, and NVIDIA's Triton documentation suggests it (its image
ships it) for the memory a model's reload leaves behind. Measured on the default pair:
docs/results/2026-12-06-tcmalloc.md.

It is preloaded (`LD_PRELOAD`) into tritonserver, whose stubs inherit the environment, from the Debian/Ubuntu
packages' places (libtcmalloc-minimal4, or libgoogle-perftools4 as in Triton's image). The stubs' periodic
heap trim (engine/host_memory.py) asks whichever allocator runs to give its free pages back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specdec.serving.gateway_process import repository_device

AUTO, TCMALLOC, GLIBC = "auto", "tcmalloc", "glibc"
CHOICES = (AUTO, TCMALLOC, GLIBC)
# The minimal build first: the allocator without gperftools' heap profiler hooks.
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRECTORIES = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                       "/usr/local/lib")
# TCMalloc reports every allocation over 1 GiB on stderr ("tcmalloc: large alloc ..."), as loading a large
# model's weights makes many: the server's log keeps to what matters. A value in the environment wins.
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
INSTALL_HINT = "apt-get install libtcmalloc-minimal4"


def find_tcmalloc(directories: tuple[str, ...] = LIBRARY_DIRECTORIES) -> str:
    """The path of an installed TCMalloc shared library, or ""."""
    for name in LIBRARIES:
        for directory in directories:
            if (Path(directory) / name).is_file():
                return str(Path(directory) / name)
    return ""


def models_on_cpu(repo: Path) -> bool:
    """Whether the repository's target_model runs on CPU (its `device` parameter)."""
    return repository_device(repo) == "cpu"


def _entries(ld_preload: str) -> list[str]:
    return [entry for entry in re.split(r"[:\s]+", ld_preload) if entry]  # ld.so takes colons and spaces


def _is_allocator(entry: str) -> bool:
    return "malloc" in Path(entry).name  # libtcmalloc*, libjemalloc*, libmimalloc*


def preloads_an_allocator(ld_preload: str) -> bool:
    """Whether LD_PRELOAD already names an allocator (TCMalloc, jemalloc, mimalloc...): the user chose."""
    return any(_is_allocator(entry) for entry in _entries(ld_preload))


def environment(choice: str, on_cpu: bool, environ: dict[str, str] | None = None,
                find=find_tcmalloc) -> tuple[dict[str, str], str]:
    """The variables that give tritonserver the chosen allocator (merged over `environ`, os.environ by default),
    and a line for the log. auto: TCMalloc when the models run on CPU, it is installed and LD_PRELOAD names no
    allocator already; tcmalloc: TCMalloc on any device (ValueError naming the flag when none is installed);
    glibc: the C library's malloc (any allocator taken out of an inherited LD_PRELOAD)."""
    if choice not in CHOICES:
        raise ValueError(f"--allocator {choice!r}: one of {', '.join(CHOICES)}")
    environ = dict(os.environ if environ is None else environ)
    inherited = environ.get("LD_PRELOAD", "")
    if choice == GLIBC:
        kept = [entry for entry in _entries(inherited) if not _is_allocator(entry)]
        return {"LD_PRELOAD": ":".join(kept)}, "allocator: glibc malloc (--allocator glibc)"
    if choice == AUTO and preloads_an_allocator(inherited):
        return {}, f"allocator: as LD_PRELOAD names ({inherited})"
    if choice == AUTO and not on_cpu:
        return {}, "allocator: glibc malloc (the models run on GPUs; --allocator tcmalloc to preload TCMalloc)"
    library = find()
    if not library:
        if choice == TCMALLOC:
            raise ValueError(f"--allocator tcmalloc: no TCMalloc library in {', '.join(LIBRARY_DIRECTORIES)} "
                             f"({INSTALL_HINT})")
        return {}, f"allocator: glibc malloc (TCMalloc serves CPU models faster: {INSTALL_HINT})"
    entries = [entry for entry in _entries(inherited) if not _is_allocator(entry)]
    variables = {key: environ.get(key, value) for key, value in QUIET.items()}
    return {"LD_PRELOAD": ":".join([library, *entries]), **variables}, f"allocator: TCMalloc ({library})"
