"""Linear layers on oneDNN with weights reordered once at load (CPU, float32/bfloat16).

Torch's default fp32 linear on CPU (MKL sgemm) repacks the weights on every call and has a slow path
for 2-9 rows. With the weight reordered once into oneDNN's blocked layout (what torch.compile's CPU
backend does when it freezes weights), a step is faster and a forward of K+1 rows costs about as much
as one of a single row: exactly the ratio speculative decoding and batching live on.

`prepack_linears` swaps every `nn.Linear` for `PrepackedLinear`; the numbers agree with the dense layer
to float rounding (unit-tested).

Which kernels are faster is the machine's: on an Intel Xeon torch's own (MKL) 1-3-row products streamed
the weights faster than the reordered ones, on an AMD EPYC oneDNN's won at every row count
(docs/results/2026-11-29-cpu-linear-kernels.md), and this project's own float32 kernel (panel_linear.py)
beat both from 2 rows on the Xeon (docs/results/2026-11-29-panel-linear.md). `linear_kernels: auto`
therefore times the model's own forward each way at load (`time_kernels`) and runs it on the fastest
(`choose`): the panel kernel where its forwards took the least time in all, else each row count on the
faster of torch's and oneDNN's (a layer may hold both layouts, torch's for 1-3 rows and oneDNN's from 4).

The timing costs seconds of a core per model at every load (the default pair's target: 16.8 s of CPU), one
model at a time on the machine, at every start and every restart after a crash. So its result is kept on
disk (`remembered_times`, SPECDEC_KERNEL_TIMES_DIR) under everything it depends on: this CPU, torch, the
kernels' build, the threads, the model's class and its linear layers' shapes, dtypes and weights (the panel
kernel's encodings follow the values); a load that finds its key reads the times instead of taking them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specdec.engine import machine_lock, panel_linear

# The row count oneDNN tunes the reordered layout for; 8 measured fastest over 1-16 rows (decode steps,
# verifies of K+1 positions, batches of sequences). Prompts of hundreds of rows still run fine.
BATCH_HINT = 8
KINDS = ("auto", "onednn", "panels", "torch")
# What `auto` times: the model's forwards of these many rows (a decode step, verifies of short chains, a
# tree), with each kernel; models whose linear weights exceed TIMED_MAX_BYTES are not timed (the timing
# holds a reordered copy of every weight) and take oneDNN's, the earlier rule.
TIMED_ROWS = (1, 2, 3, 4, 5, 8)
TIMED_MAX_BYTES = 2 << 30
# torch's own kernels pad 2-3-row forwards to this many rows where that measures faster (some BLAS builds
# take a slower path below 4 rows; padding rows are dropped, transformers_forward.padded_rows)
TORCH_PADDED_ROWS = 4
# Where `remembered_times` keeps timings: this variable's directory ("" keeps none: every load times), else
# specdec-kernel-times in the temporary directory. The image points it into its cache volume.
TIMES_DIR_ENV = "SPECDEC_KERNEL_TIMES_DIR"


class PrepackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's reordered layout. x: (..., in_features).

    torch_below > 1: forwards of fewer rows than that run torch's own kernel on the dense weight, kept for
    them (where those measured faster, `choose`)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, torch_below: int = 1):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.torch_below = torch_below
        # buffers (not saved): what the module holds, seen by whoever asks a model for its tensors' dtype
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                                     batch_hint), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)
        # the dense weight (a tied head's is its embedding: no copy) only where some forwards use it
        self.register_buffer("dense_weight", linear.weight.detach() if torch_below > 1 else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_weight is not None and x.numel() < self.torch_below * self.in_features:
            return nn.functional.linear(x, self.dense_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        below = f", torch's kernel below {self.torch_below} rows" if self.dense_weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn{below}"


@dataclass(frozen=True)
class KernelTimes:
    """Seconds of the model's forward at each row count (TIMED_ROWS) with each kernel (panels: None where
    the panel kernel does not run)."""

    torch: dict[int, float]
    onednn: dict[int, float]
    linear_bytes: int
    panels: dict[int, float] | None = None
    remembered: str | None = None  # read from disk (`remembered_times`): when they were taken, and where kept

    def mixed(self) -> dict[int, float]:
        """Each row count's seconds on torch's kernels below `onednn_from` and oneDNN's from there."""
        start = self.onednn_from
        return {rows: self.torch[rows] if start is None or rows < start else self.onednn[rows] for rows in self.torch}

    @property
    def panels_faster(self) -> bool:
        """Whether the panel kernel's forwards took less time in all than the best of torch's and oneDNN's."""
        return self.panels is not None and sum(self.panels.values()) < sum(self.mixed().values())

    @property
    def onednn_from(self) -> int | None:
        """The fewest timed rows from which oneDNN's forward was the faster at every larger timed row count
        too; None: torch's was faster at the largest."""
        start = None
        for rows in sorted(self.torch, reverse=True):
            if self.onednn[rows] >= self.torch[rows]:
                break
            start = rows
        return start

    @property
    def torch_min_rows(self) -> int:
        """min_forward_rows with torch's kernels: TORCH_PADDED_ROWS where its 2- and 3-row passes are slower."""
        padded = self.torch.get(TORCH_PADDED_ROWS)
        slower = [self.torch[rows] for rows in range(2, TORCH_PADDED_ROWS) if rows in self.torch]
        return TORCH_PADDED_ROWS if padded is not None and slower and padded < min(slower) else 1

    def summary(self) -> str:
        def row(times):
            return ", ".join(f"{rows}: {seconds * 1e3:.2f}" for rows, seconds in times.items())
        panels = "" if self.panels is None else f", panels {{{row(self.panels)}}}"
        remembered = "" if self.remembered is None else f"; {self.remembered}"
        return (f"forwards timed with {self.linear_bytes / 2**20:.0f} MiB of linear weights, ms by rows: "
                f"torch {{{row(self.torch)}}}, oneDNN {{{row(self.onednn)}}}{panels}{remembered}")

    def to_json(self) -> dict:
        return {"torch": self.torch, "onednn": self.onednn, "linear_bytes": self.linear_bytes, "panels": self.panels}

    @classmethod
    def from_json(cls, data: dict, remembered: str | None = None) -> "KernelTimes":
        def rows(times):
            return None if times is None else {int(n): float(seconds) for n, seconds in times.items()}
        return cls(rows(data["torch"]), rows(data["onednn"]), int(data["linear_bytes"]), rows(data["panels"]),
                   remembered)


def causal_lm_forward(model: nn.Module) -> Callable[[int], object]:
    """forward(n): a transformers causal LM over n random tokens (no cache), logits at every row as a
    verify's; what `time_kernels` times for a target or a draft model."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, max(TIMED_ROWS)), generator=torch.Generator().manual_seed(0))
    return lambda n: model(input_ids=ids[:, :n].to(next(model.parameters()).device), use_cache=False)


@torch.inference_mode()
def time_kernels(model: nn.Module, forward: Callable[[int], object], rows: tuple[int, ...] = TIMED_ROWS,
                 repeats: int = 3, budget_s: float = 1.0, most_repeats: int = 25,
                 kept: Callable[[], KernelTimes | None] | None = None) -> KernelTimes:
    """The model's forward over each row count (`forward(n)`) with its linears on torch's kernels, on
    oneDNN's reordered weights and, where it runs (float32), on the panel kernel (each swapped in for the
    timing, a copy of each weight meanwhile), the quickest of at least `repeats`, interleaved so a noisy
    machine's slow moments fall on all, one model's timing at a time on the machine (`_timing_alone`). The
    model is left on torch's kernels.

    A small model (a draft head) repeats as often as fits `budget_s` (at most `most_repeats`), going by its
    untimed first pass: the other stubs load beside the timing, and with 3 repeats of a head's millisecond
    forwards the default pair's head went to torch's kernels in some starts, its served step twice as slow.

    `kept()`, asked once the machine's timing lock is held, may return times another process took meanwhile
    (`remembered_times`): those are returned untimed. The layers' copies are made before the lock: encoding
    a target's weights for the panel kernel takes seconds, which overlap another model's timing."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not linears:
        raise ValueError("the model has no linear layers to time")
    weight = linears[0][2].weight
    layers = {"torch": [child for _, _, child in linears], "onednn": [PrepackedLinear(child) for _, _, child in linears]}
    if panel_linear.available(weight.device, weight.dtype) is None:
        layers["panels"] = [panel_linear.PanelLinear(child) for _, _, child in linears]

    def use(kind: str) -> None:
        for (parent, name, _), layer in zip(linears, layers[kind]):
            setattr(parent, name, layer)

    seconds: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in rows} for kind in layers}
    try:
        with _timing_alone():
            if kept is not None and (times := kept()) is not None:
                return times
            started = time.perf_counter()
            for n in rows:  # once untimed: oneDNN builds its kernel for each shape on first use
                for kind in seconds:
                    use(kind)
                    forward(n)
            first_pass = time.perf_counter() - started
            repeats = max(repeats, min(most_repeats, int(budget_s / max(first_pass, 1e-6))))
            for _ in range(repeats):
                for n in rows:
                    for kind in seconds:
                        use(kind)
                        started = time.perf_counter()
                        forward(n)
                        seconds[kind][n].append(time.perf_counter() - started)
    finally:
        use("torch")
    # the quickest of each: what the kernel costs when nothing else on the machine intervenes
    quickest = {kind: {n: min(values) for n, values in by_rows.items()} for kind, by_rows in seconds.items()}
    return KernelTimes(quickest["torch"], quickest["onednn"], linear_bytes(model), quickest.get("panels"))


def times_directory() -> Path | None:
    """Where timings are kept (TIMES_DIR_ENV), or None: nowhere."""
    value = os.environ.get(TIMES_DIR_ENV)
    if value is None:
        return Path(tempfile.gettempdir()) / "specdec-kernel-times"
    return Path(value) if value else None


def timing_key(model: nn.Module, rows: tuple[int, ...]) -> dict:
    """Everything a model's kernel times depend on: the machine and its kernels' build (panel_linear's
    digest: the sources, flags, torch and this CPU; whether it built), the threads a forward runs on, the forward's rows, and
    the model: its class, and each linear layer's shape, dtype, device and a sample of its weights (the
    panel kernel holds a layer in the fewest bytes its values allow: another checkpoint of the same shapes
    may time otherwise)."""
    weights = hashlib.sha256()
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach()
            layers.append([name, list(weight.shape), str(weight.dtype), module.bias is not None])
            flat = weight.reshape(-1)
            weights.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    weight = next(model.parameters())
    return {"kernels": panel_linear.build_digest(), "threads": torch.get_num_threads(), "rows": list(rows),
            # a build that failed once (no compiler then) is timed again where it builds now
            "panels": panel_linear.available(weight.device, weight.dtype) is None,
            "device": str(weight.device), "model": type(model).__name__, "linears": layers,
            "weights": weights.hexdigest(), "encodings": sorted(panel_linear.allowed_encodings())}


def remembered_times(model: nn.Module, forward: Callable[[int], object],
                     rows: tuple[int, ...] = TIMED_ROWS) -> KernelTimes:
    """The model's kernel times (`time_kernels`), read from `times_directory()` where a load with the same
    `timing_key` kept them, else taken (one timing at a time on the machine: a server's stubs that load the
    same model at once time it once) and kept. A file that cannot be read, or written, is timed around."""
    directory = times_directory()
    if directory is None:
        return time_kernels(model, forward, rows=rows, kept=None)
    key = timing_key(model, rows)
    path = directory / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}.json"
    if (times := _read_times(path, key)) is not None:
        return times
    times = time_kernels(model, forward, rows=rows, kept=lambda: _read_times(path, key))
    if times.remembered is not None:  # timed by another process while this one waited for the lock
        return times
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps({"key": key, "timed_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                       "times": times.to_json()}, sort_keys=True))
        os.replace(staging, path)  # whole or not at all, for a reader in another process
    except OSError:
        pass
    return times


def _read_times(path: Path, key: dict) -> KernelTimes | None:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:  # a digest's collision, in theory
            return None
        return KernelTimes.from_json(data["times"], f"timed {data['timed_at']}, kept in {path}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def linear_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


def _timing_alone():
    """One timing at a time on this machine: a server's model stubs load together, and timed side by side
    they share the cores and the memory bus (measured: the target's passes several times slower, and the
    choice flipped). An advisory lock in the temporary directory."""
    return machine_lock.held(os.path.join(tempfile.gettempdir(), "specdec-linear-kernels.lock"))


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN's reordered weights cannot serve a model on this device in this dtype (None: they can)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return f"needs a CPU model in float32 or bfloat16 with oneDNN, got {device.type} {dtype}"
    # oneDNN reorders bfloat16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: not on AMD's Zen 3
    # and earlier, nor on most client Intel CPUs, where the reorder raises at load
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ("bfloat16 needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for oneDNN's kernels, and this "
                "one has neither")
    return None


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return unsupported(device, dtype) is None


def resolve(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a `linear_kernels` setting may replace torch's kernels: auto = where supported (`choose`
    times it there); onednn and panels = required (ValueError, saying why, where they cannot run)."""
    if kind not in KINDS:
        raise ValueError(f"linear_kernels must be one of {KINDS}, got {kind!r}")
    if kind == "onednn" and (problem := unsupported(device, dtype)) is not None:
        raise ValueError(f"linear_kernels=onednn {problem}")
    if kind == "panels" and (problem := panel_linear.available(device, dtype)) is not None:
        raise ValueError(f"linear_kernels=panels: {problem}")
    return kind in ("onednn", "panels") or (kind == "auto" and supported(device, dtype))


@dataclass(frozen=True)
class KernelChoice:
    """What a model's linear layers run on (`choose`): the panel kernel throughout (`panels`), or oneDNN's
    reordered weights from `onednn_from` rows up (1: always; None: never, torch's own kernels), torch's
    below; and the row count torch's own pad 2-3-row forwards to (None: the executor's default rule)."""

    onednn_from: int | None
    min_forward_rows: int | None = None
    times: KernelTimes | None = None
    panels: bool = False

    @property
    def name(self) -> str:
        """A short name for tables: panels, torch, onednn, or the switch between the last two."""
        if self.panels:
            return "panels"
        if self.onednn_from is None:
            return "torch"
        return "onednn" if self.onednn_from == 1 else f"torch < {self.onednn_from} rows, onednn"

    def summary(self) -> str:
        if self.panels:
            kernels = "the panel kernel (panel_linear.py)"
        elif self.onednn_from is None:
            kernels = "torch's own kernels"
            if (self.min_forward_rows or 1) > 1:
                kernels += f", 2-{self.min_forward_rows - 1} rows padded to {self.min_forward_rows}"
        elif self.onednn_from == 1:
            kernels = "oneDNN's reordered weights"
        else:
            kernels = (f"torch's own kernels below {self.onednn_from} rows, oneDNN's reordered weights from there "
                       f"(both copies of the weights held)")
        if self.times is None:
            return f"linear layers on {kernels}"
        return f"linear layers on {kernels}, the faster as timed on this machine ({self.times.summary()})"


TORCH = KernelChoice(onednn_from=None)
ONEDNN = KernelChoice(onednn_from=1)
PANELS = KernelChoice(onednn_from=None, min_forward_rows=1, panels=True)


def choose(kind: str, model: nn.Module, forward: Callable[[int], object] | None = None) -> KernelChoice:
    """The `linear_kernels` setting for this model on this machine: onednn, panels and torch as asked (the
    first two only where they run); auto, where supported, times the model's forward each way
    (`remembered_times`; `forward`: `causal_lm_forward` unless given) and takes the panel kernel where its
    forwards took the least time in all, else runs each row count on the faster of torch's and oneDNN's
    (`KernelTimes.onednn_from`), torch's kernels padding 2-3-row forwards only where that measured faster."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if not resolve(kind, device, dtype):
        return TORCH
    if kind == "panels":
        return PANELS
    if kind == "onednn" or linear_bytes(model) > TIMED_MAX_BYTES:
        return ONEDNN
    times = remembered_times(model, forward or causal_lm_forward(model))
    if times.panels_faster:
        return KernelChoice(onednn_from=None, min_forward_rows=1, times=times, panels=True)
    start = times.onednn_from
    if start == min(times.torch):
        return KernelChoice(onednn_from=1, times=times)
    return KernelChoice(onednn_from=start, min_forward_rows=times.torch_min_rows if start is None else 1, times=times)


def apply(kind: str, model: nn.Module, name: str = "", log=None,
          forward: Callable[[int], object] | None = None) -> KernelChoice:
    """`choose`, then prepack the model's linears as that chose; the choice is kept as
    `model.linear_kernel_choice` (the executor pads forwards' rows as it says) and, timed, told to `log`."""
    choice = choose(kind, model, forward)
    if choice.panels:
        panel_linear.pack_linears(model)
    elif choice.onednn_from is not None:
        prepack_linears(model, torch_below=choice.onednn_from)
    model.linear_kernel_choice = choice
    if log is not None and choice.times is not None:
        log(f"{name}: {choice.summary()}")
        weight = next(model.parameters())
        if choice.times.panels is None and (problem := panel_linear.available(weight.device, weight.dtype)):
            log(f"{name}: the panel kernel was not timed: {problem}")
    if log is not None and choice.panels:
        log(f"{name}: panel weights held exactly as {panel_linear.encodings(model)}")
    return choice


@torch.no_grad()
def prepack_linears(model: nn.Module, torch_below: int = 1) -> int:
    """Replace every nn.Linear in `model` (in place) with a PrepackedLinear (`torch_below`: its); returns how many.

    Inference only: the reordered weights are copies outside autograd (a tied head keeps its embedding).
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PrepackedLinear(child, torch_below=torch_below))
                replaced += 1
    return replaced
