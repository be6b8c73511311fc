"""Linear layers on this project's own CPU kernel (float32): weights packed once into column panels.

Why a kernel of our own: a decode step, and a verify of K+1 rows, streams every weight once and does
almost no arithmetic per byte. The kernels torch brings (MKL's sgemm, oneDNN's reordered weights) lose
a third or more of the memory bandwidth somewhere between 2 and 9 rows, exactly the rows speculative
decoding verifies; csrc/panel_linear.cpp streams each panel of 64 output columns once per block of rows
with the partial sums in registers (block shapes per instruction set: 6 rows with AVX-512, where a forward
of 1-6 rows costs about what 1 row costs, docs/results/2026-11-29-panel-linear.md; 2 rows with AVX2, past
them tiles of the panel decoded once into L1 for all rows, docs/results/2026-11-30-avx2-panels.md and
2026-11-30-avx2-tiles.md). It also sums every output in one fixed order whatever the
row count: a verify's rows give, bit for bit, what the same rows give one step at a time.

A layer's weights are held in the fewest bytes that give back every float32 exactly (`encode`): 4-bit
codes with a scale and offset per 32 inputs (GGUF's Q4_1: the default pair's layers), 8-bit codes with a
scale (Q8_0: its tied embedding and head), bfloat16 (a head trained and shipped in bfloat16), else float32.
Each weight is checked at load to decode to itself bit for bit, and the kernel computes the same float32
products in the same order whatever the encoding: the outputs are the float32 kernel's, bit for bit, for
a sixth to a half of the bytes a forward streams.

The kernel is compiled on first use on the machine that runs it (`-march=native`; torch's C++ extension
builder, ninja and the system's C++ compiler), cached under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions) in a directory named after the source, the flags, torch and this CPU, so a
cache shared by different machines never hands one CPU another's instructions. Where it cannot be built
`build()` says why and the loader keeps the other kernels (onednn_linear.choose).

The same build compiles csrc/cpu_layer.cpp, the rest of a layer on the CPU (`kernels.cpu()`): one
machine-specific module, one build to wait for.

Shapes: x (..., K) -> y (..., N); panels (ceil(N / 64), K, 64), panels[p, k, c] = W[64 p + c, k]; the
encodings' codes and per-block scales follow the same panel order (csrc/panel_linear.cpp).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import platform
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.engine import machine_lock

SOURCE = Path(__file__).with_name("csrc") / "panel_linear.cpp"
# Built into the same module: the layer's pointwise work and attention on the CPU (kernels.cpu(), one build)
LAYER_SOURCE = SOURCE.with_name("cpu_layer.cpp")
HEADER, BINDINGS = SOURCE.with_name("kernels.h"), SOURCE.with_name("bindings.cpp")  # the entry points, bound apart
PANEL = 64  # the kernel's panel width (csrc/panel_linear.cpp's PANEL; checked against it when built)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
# -fopenmp links libgomp.so.1 by name: in a process where torch is loaded that is torch's own runtime,
# so the kernel's threads are torch's (torch.set_num_threads holds for it too).
LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Build:
    """The compiled kernel (`op(x, panels, out_features)` and its encoded-weight variants in `module`), or
    None and why not."""

    op: object | None
    problem: str | None = None
    module: object | None = None


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
def build_digest() -> str:
    """What a build is made of: the sources, the flags, torch and this CPU (a build's directory is named
    after it; onednn_linear keeps its timings under it too)."""
    source = SOURCE.read_text() + "\n" + LAYER_SOURCE.read_text()
    return hashlib.sha256("\0".join([source, HEADER.read_text(), BINDINGS.read_text(), *CFLAGS, *LDFLAGS,
                                     torch.__version__, _cpu_identity()]).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def build() -> Build:
    """Compile (or load the cached build of) the kernel, once per process; one build at a time per machine
    (a file lock: a server's model stubs load together)."""
    try:
        # Two translation units, compiled in parallel: the kernels (both sources as one, against ATen's
        # few headers) and their bindings (pybind11 and torch's tensor conversions)
        source = SOURCE.read_text() + "\n" + LAYER_SOURCE.read_text()
        name = f"specdec_panel_linear_{build_digest()}"
        directory = _extensions_dir() / name
        directory.mkdir(parents=True, exist_ok=True)
        from torch.utils.cpp_extension import load

        with machine_lock.held(directory.with_suffix(".building")), _ninja_on_path():
            # torch's builder guards a build with a "lock" file it deletes when done; a process killed
            # mid-build leaves it behind and every later build would wait on it forever. Holding our own
            # lock (released by the kernel when a process dies), nobody else is building: it is stale.
            with contextlib.suppress(FileNotFoundError):
                (directory / "lock").unlink()
            kernels = directory / "kernels.cpp"
            if not kernels.exists() or kernels.read_text() != source:  # rewritten, ninja would rebuild it
                kernels.write_text(source)
            module = load(name, sources=[str(kernels), str(BINDINGS)], extra_include_paths=[str(SOURCE.parent)],
                          extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                          verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the other kernels serve
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        return Build(None, f"{type(exc).__name__}: {lines[-1] if lines else exc}")
    if module.panel_width() != PANEL:
        return Build(None, f"the compiled kernel's panels are {module.panel_width()} wide, this module's {PANEL}")
    return Build(module.panel_linear, module=module)


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


BLOCK = 32  # inputs per scale in the 4- and 8-bit encodings (GGUF's blocks)
ENCODINGS = ("q4", "q8", "bf16", "float32")  # the fewest bytes first
KERNELS = {"q4": "panel_linear_q4", "q8": "panel_linear_q8", "bf16": "panel_linear_bf16",
           "float32": "panel_linear"}  # each encoding's entry point in the compiled module
# A comma-separated subset of ENCODINGS the loader may use (float32 always): to measure one against another
ENCODINGS_ENV = "SPECDEC_PANEL_ENCODINGS"


def allowed_encodings() -> frozenset[str]:
    value = os.environ.get(ENCODINGS_ENV, "")
    allowed = {name.strip() for name in value.split(",") if name.strip()} if value.strip() else set(ENCODINGS)
    unknown = allowed - set(ENCODINGS)
    if unknown:
        raise ValueError(f"{ENCODINGS_ENV}={value!r}: unknown encodings {sorted(unknown)} (known: {list(ENCODINGS)})")
    return frozenset(allowed | {"float32"})


@dataclass(frozen=True)
class Encoded:
    """A weight as the kernel streams it: `kind` (ENCODINGS) and its panels-ordered tensors."""

    kind: str
    tensors: tuple[torch.Tensor, ...]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    n, k = weight.shape
    return None if k % BLOCK else weight.reshape(n, k // BLOCK, BLOCK)


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes, scale, offset) with weight == codes * scale + offset bit for bit (codes 0-15 uint8 (N, K);
    scale, offset (N, K / 32): one per block of 32 inputs), or None where the weight is not so made.

    A Q4_1 block's offset is its least value (code 0) and its scale a half-precision (max - min) / 15
    (the greatest value has code 15): both are read back from the block and every value checked."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    scale = ((high - low) / 15).half().float()
    codes = ((blocks - low) / torch.where(scale > 0, scale, 1.0)).round().clamp(0, 15)
    if not (torch.isfinite(scale).all() and _same_bits(codes * scale + low, blocks)):
        return None
    n, k = weight.shape
    return codes.to(torch.uint8).view(n, k), scale.view(n, -1), low.view(n, -1)


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes, scale) with weight == codes * scale bit for bit (codes -127..127 int8 (N, K), scale
    (N, K / 32)), or None. A Q8_0 block's scale is its greatest magnitude / 127 (that value's code ±127)."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = (blocks / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127)
    if not (torch.isfinite(scale).all() and _same_bits(codes * scale, blocks)):
        return None
    n, k = weight.shape
    return codes.to(torch.int8).view(n, k), scale.view(n, -1)


def round_q8(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) -> the nearest weight q8_blocks holds exactly (`weights_dtype: q8`): per block of 32
    inputs, codes -127..127 times the block's greatest magnitude / 127, float32. Lossy (about 0.5 % of
    the weights' norm); K not a multiple of 32: the weight as it is.

    The scale is taken where dividing 127 times it by 127 gives it back, so that q8_blocks, which reads
    each block's scale back from its greatest value (code ±127), finds the same one."""
    blocks = _blocks(weight.detach().float())
    if blocks is None:
        return weight.detach().float()
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    for _ in range(4):  # a fixed point of s -> (127 s) / 127 in float32 (one or two steps)
        scale = (scale * 127) / 127
    codes = (blocks / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127)
    return (codes * scale).view(weight.shape)


@torch.no_grad()
def quantize_linears(model: nn.Module) -> int:
    """Round every nn.Linear weight of `model` to 8-bit blocks in place (`round_q8`; a weight tied to the
    embedding gets its own copy, the embedding keeps its values): the panel kernel then streams each as
    its 8-bit codes. Weights already held exactly in 4- or 8-bit blocks (a GGUF model's) stay as they are.
    Returns how many were rounded."""
    replaced = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.shape[1] % BLOCK == 0:
            weight = module.weight.detach().float()
            if q4_blocks(weight) is not None or q8_blocks(weight) is not None:
                continue
            module.weight = nn.Parameter(round_q8(module.weight).to(module.weight.dtype), requires_grad=False)
            replaced += 1
    return replaced


def _pack_blocks(values: torch.Tensor) -> torch.Tensor:
    """Per-block values (N, K / 32) -> (P, K / 32, PANEL), float32, the missing columns zero."""
    return pack(values.float())


def encode(weight: torch.Tensor, allowed: frozenset[str] | None = None) -> Encoded:
    """The weight (N, K) float32 in the first of ENCODINGS (of `allowed`, default `allowed_encodings()`)
    that holds every value exactly, packed."""
    allowed = allowed_encodings() if allowed is None else allowed
    weight = weight.detach().float().contiguous()
    if "q4" in allowed and (q4 := q4_blocks(weight)) is not None:
        codes, scale, offset = q4
        panels = pack(codes)  # (P, K, 64): column j of the panel in the low nibble, j + 32 in the high one
        return Encoded("q4", ((panels[..., :PANEL // 2] | (panels[..., PANEL // 2:] << 4)).contiguous(),
                              _pack_blocks(scale), _pack_blocks(offset)))
    if "q8" in allowed and (q8 := q8_blocks(weight)) is not None:
        codes, scale = q8
        return Encoded("q8", (pack(codes), _pack_blocks(scale)))
    if "bf16" in allowed and _same_bits(weight.bfloat16().float(), weight):
        return Encoded("bf16", (pack(weight.bfloat16()),))
    return Encoded("float32", (pack(weight),))


class PanelLinear(nn.Module):
    """y = x @ W^T + b with W in panels (`pack`), encoded (`encode`), on the compiled kernel.
    x: (..., in_features), float32. Inference only: the kernel has no backward."""

    def __init__(self, linear: nn.Linear, encoding: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        built = build()
        if built.op is None:
            raise RuntimeError(f"the panel kernel is unavailable: {built.problem}")
        encoded = encode(linear.weight.detach(), None if encoding else frozenset({"float32"}))
        self.encoding = encoded.kind
        self.op = getattr(built.module, KERNELS[encoded.kind])
        # buffers (not saved): what the module holds, seen by whoever asks a model for its tensors' dtype
        self.weight_names = tuple(f"panels{index or ''}" for index in range(len(encoded.tensors)))
        for name, tensor in zip(self.weight_names, encoded.tensors):
            self.register_buffer(name, tensor, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    @property
    def weights(self) -> tuple[torch.Tensor, ...]:
        buffers = self._buffers
        return tuple(buffers[name] for name in self.weight_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Lean on purpose: a forward of the default pair's target makes 211 of these calls.
        buffers = self._buffers
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        y = self.op(flat, *[buffers[name] for name in self.weight_names], self.out_features)
        bias = buffers["bias"]
        if bias is not None:
            y += bias
        return y if flat is x else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, panels of {PANEL}, "
                f"{self.encoding}")


def fuse(linears: list[PanelLinear]) -> PanelLinear | None:
    """One PanelLinear for linears that read the same input (a layer's query, key and value projections;
    an MLP's gate and up): their outputs side by side from one call. Each output column is the same sum
    as before, so the outputs are bit for bit the separate ones. The originals' tensors become views of
    the fused ones (no memory added). None unless they share an encoding and a bias or its absence and
    every one but the last fills whole panels."""
    first = linears[0]
    if len({(m.encoding, m.in_features, m.bias is None) for m in linears}) > 1 \
            or any(m.out_features % PANEL for m in linears[:-1]):
        return None
    fused = copy.copy(first)  # the module's settings; its buffers replaced below
    fused._buffers = dict(first._buffers)
    fused.out_features = sum(m.out_features for m in linears)
    sizes = [m.weights[0].shape[0] for m in linears]  # panels each
    for index, name in enumerate(first.weight_names):
        whole = torch.cat([m.weights[index] for m in linears])
        fused._buffers[name] = whole
        for m, part in zip(linears, whole.split(sizes)):
            m._buffers[name] = part
    if first.bias is not None:
        fused._buffers["bias"] = torch.cat([m.bias for m in linears])
    return fused


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` (in place) with a PanelLinear; returns how many. The packed
    weights are copies (a tied head keeps its embedding for the lookup)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PanelLinear(child))
                replaced += 1
    return replaced


def encodings(model: nn.Module) -> str:
    """How a packed model's linears are held, e.g. "210 in 4-bit blocks, 1 in 8-bit blocks (92 MiB)"."""
    layers = [module for module in model.modules() if isinstance(module, PanelLinear)]
    counts = Counter(layer.encoding for layer in layers)
    names = {"q4": "4-bit blocks", "q8": "8-bit blocks", "bf16": "bfloat16", "float32": "float32"}
    total = sum(t.nbytes for layer in layers for t in layer.weights)
    return ", ".join(f"{counts[kind]} in {names[kind]}" for kind in ENCODINGS if counts[kind]) + \
        f" ({total / 2**20:.0f} MiB)"
