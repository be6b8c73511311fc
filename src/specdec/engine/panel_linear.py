"""Linear layers on this project's own CPU kernel (float32): weights packed once into column panels.

Why a kernel of our own: a decode step, and a verify of K+1 rows, streams every weight once and does
almost no arithmetic per byte. The kernels torch brings (MKL's sgemm, oneDNN's reordered weights) lose
a third or more of the memory bandwidth somewhere between 2 and 9 rows, exactly the rows speculative
decoding verifies; csrc/panel_linear.cpp streams each panel of 64 output columns once per 6 rows with
the partial sums in registers, so a forward of 1-6 rows costs about what 1 row costs (9 rows 1.3x)
(docs/results/2026-11-29-panel-linear.md). It also sums every output in one fixed order whatever the
row count: a verify's rows give, bit for bit, what the same rows give one step at a time.

The kernel is compiled on first use on the machine that runs it (`-march=native`; torch's C++ extension
builder, ninja and the system's C++ compiler), cached under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions) in a directory named after the source, the flags, torch and this CPU, so a
cache shared by different machines never hands one CPU another's instructions. Where it cannot be built
`build()` says why and the loader keeps the other kernels (onednn_linear.choose).

Shapes: x (..., K) -> y (..., N); panels (ceil(N / 64), K, 64), panels[p, k, c] = W[64 p + c, k].
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.engine import machine_lock

SOURCE = Path(__file__).with_name("csrc") / "panel_linear.cpp"
PANEL = 64  # the kernel's panel width (csrc/panel_linear.cpp's PANEL; checked against it when built)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
# -fopenmp links libgomp.so.1 by name: in a process where torch is loaded that is torch's own runtime,
# so the kernel's threads are torch's (torch.set_num_threads holds for it too).
LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Build:
    """The compiled kernel (`op(x, panels, out_features)`), or None and why not."""

    op: object | None
    problem: str | None = None


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def _cpu_identity() -> str:
    """What the compiled code depends on: the architecture and, on Linux, the CPU's model and flags."""
    identity = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                identity += line
                if line.startswith(("flags", "Features")):
                    break
    return identity


def _extensions_dir() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                  "torch_extensions")
    with contextlib.suppress(OSError):
        os.makedirs(base, exist_ok=True)
        if os.access(base, os.W_OK):
            return Path(base)
    return Path(tempfile.gettempdir()) / "torch_extensions"  # a home without a writable cache (a container)


@functools.lru_cache(maxsize=None)
def build() -> Build:
    """Compile (or load the cached build of) the kernel, once per process; one build at a time per machine
    (a file lock: a server's model stubs load together)."""
    try:
        source = SOURCE.read_text()
        digest = hashlib.sha256("\0".join([source, *CFLAGS, *LDFLAGS, torch.__version__, _cpu_identity()])
                                .encode()).hexdigest()[:16]
        name = f"specdec_panel_linear_{digest}"
        directory = _extensions_dir() / name
        directory.mkdir(parents=True, exist_ok=True)
        from torch.utils.cpp_extension import load_inline

        with machine_lock.held(directory.with_suffix(".building")), _ninja_on_path():
            # torch's builder guards a build with a "lock" file it deletes when done; a process killed
            # mid-build leaves it behind and every later build would wait on it forever. Holding our own
            # lock (released by the kernel when a process dies), nobody else is building: it is stale.
            with contextlib.suppress(FileNotFoundError):
                (directory / "lock").unlink()
            module = load_inline(name, cpp_sources=[source], functions=["panel_linear", "panel_width"],
                                 extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                 build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the other kernels serve
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        return Build(None, f"{type(exc).__name__}: {lines[-1] if lines else exc}")
    if module.panel_width() != PANEL:
        return Build(None, f"the compiled kernel's panels are {module.panel_width()} wide, this module's {PANEL}")
    return Build(module.panel_linear)


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder runs `ninja` from PATH, and a server started as `.venv/bin/python -m ...` (make
    serve) has no virtualenv's bin there: the ninja package's own directory goes first while building."""
    try:
        import ninja
        directory = ninja.BIN_DIR
    except (ImportError, AttributeError):  # a system ninja, if any, is all there is
        yield
        return
    previous = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(filter(None, [directory, previous]))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = previous


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None where the kernel runs for a model on `device` in `dtype`, else why not."""
    if not supported(device, dtype):
        return f"the panel kernel runs float32 models on the CPU, not {device.type} {dtype}"
    return build().problem


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) -> panels (ceil(N / PANEL), K, PANEL), the last panel's missing columns zero."""
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = torch.zeros(count * PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(count, PANEL, k).transpose(1, 2).contiguous()


class PanelLinear(nn.Module):
    """y = x @ W^T + b with W in panels (`pack`), on the compiled kernel. x: (..., in_features), float32.
    Inference only: the kernel has no backward."""

    def __init__(self, linear: nn.Linear, op=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.op = op or build().op
        if self.op is None:
            raise RuntimeError(f"the panel kernel is unavailable: {build().problem}")
        # buffers (not saved): what the module holds, seen by whoever asks a model for its tensors' dtype
        self.register_buffer("panels", pack(linear.weight.detach()), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.op(x.reshape(-1, self.in_features).contiguous(), self.panels, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels of {PANEL}"


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` (in place) with a PanelLinear; returns how many. The packed
    weights are copies (a tied head keeps its embedding for the lookup)."""
    op = build().op
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PanelLinear(child, op))
                replaced += 1
    return replaced
