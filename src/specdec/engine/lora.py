"""LoRA adapters served over one base model: each sequence runs the base weights plus, at every adapted
projection, its adapter's low-rank product (W x + s B A x), the adapters of a forward's rows side by side.

An adapter is PEFT's layout (what `peft`, vLLM, SGLang and TensorRT-LLM's converters read): a directory
with `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`) and
`adapter_model.safetensors` (or `adapter_model.bin`) holding per adapted linear
`base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight` (r, in) and `lora_B.weight`
(out, r); the scale s is lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). The projections a Llama-family
layer has can be adapted (q, k, v, o, gate, up, down); an adapter of the embedding, the head or a bias, or
whose shapes or layers are not the model's, is refused at load naming its path and what does not fit.

The forward (`llama_forward.LlamaForward`) has `AdapterSet.add` each product's addition: where every row
runs one adapter (eagerly the host knows), that adapter's two small products; where rows run several, or a
CUDA graph is captured (its shapes fixed, its rows' adapters data), every adapter's low-rank product for
every row, each row keeping its own adapter's columns: two dense products reading every adapter's
matrices (what they cost grows with the adapters served, not with the rows; a few operations a product,
where grouping rows by adapter took a few per adapter, and on a CPU's millisecond steps the operations are
what costs). Nothing is added where every row is the base model's (slot 0). A layer's query/key/value (and
gate/up) products run fused, so an adapter's A matrices of a group are stacked along the rank and its B
matrices placed block-diagonally: one pair of products per group.

Speculation stays exact with respect to the adapted model: the target verifies with the adapter, the
drafts (which run the base model, or read the adapted target's features) only propose.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from specdec.engine.errors import CapacityError
from specdec.engine.lora_config import CONFIG, NAME, WEIGHTS, directory_adapter, slot_count

# A layer's adaptable projections, in the order the forward fuses them: its module and its product group.
MODULES = {"q_proj": ("self_attn", "qkv"), "k_proj": ("self_attn", "qkv"), "v_proj": ("self_attn", "qkv"),
           "o_proj": ("self_attn", "o"), "gate_proj": ("mlp", "gate_up"), "up_proj": ("mlp", "gate_up"),
           "down_proj": ("mlp", "down")}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
# PEFT's key of a layer's projection's A or B (vLLM's renamed copies drop the prefix; an adapter name may follow)
# With a lora_directory and no max_lora_rank given: vLLM's --max-lora-rank default (its slots:
# lora_config.slot_count; vLLM's --max-loras is 1, a few let a few adapters' requests run side by side)
DIRECTORY_RANK = 16
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: per (layer, module) its A (r, in) and B (out, r) with the scale folded into B."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _shapes(model) -> dict[str, tuple[int, int]]:
    """Each adaptable module's (in, out) features in the model's first layer (every layer alike)."""
    layer = model.model.layers[0]
    out = {}
    for name, (part, _) in MODULES.items():
        module = getattr(getattr(layer, part), name)
        weight = getattr(module, "weight", None)
        shape = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if None in shape and weight is not None and weight.dim() == 2:
            shape = (weight.shape[1], weight.shape[0])
        out[name] = shape
    return out


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHTS:
        file = directory / name
        if file.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(str(file))
            return torch.load(str(file), map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {directory}: no {' or '.join(WEIGHTS)}")


def load_adapter(name: str, path: str | Path, model, layers: tuple[int, ...] | None = None) -> Adapter:
    """The adapter at `path` (PEFT's layout) for `model`, in the model's dtype on its device; ValueError
    naming the path and what does not fit the model. `layers`: the adapter's layer each of the model's layers
    is (a draft made of some of the target's layers, which runs the target's adapters on those: the adapter's
    weights for other layers are left out, and an adapter of none of them is the base model); None: the
    model is the one the adapter was trained for."""
    directory = Path(path)
    where = f"LoRA adapter {name!r} ({directory})"
    if not NAME.match(name):
        raise ValueError(f"{where}: a name is letters, digits and . _ : / - (at most 128), got {name!r}")
    if not (directory / CONFIG).is_file():
        raise ValueError(f"{where}: no {CONFIG}")
    config = json.loads((directory / CONFIG).read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise ValueError(f"{where}: trained biases or modules_to_save are not served (bias={config.get('bias')!r}, "
                         f"modules_to_save={config.get('modules_to_save')!r})")
    if config.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters are not served")
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if rank <= 0:
        raise ValueError(f"{where}: r must be > 0, got {config.get('r')!r}")
    fan_in_fan_out = bool(config.get("fan_in_fan_out", False))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    count, shapes = len(model.model.layers), _shapes(model)
    own_layer = None if layers is None else {layer: i for i, layer in enumerate(layers)}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(directory).items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: {key} is not a LoRA weight of a decoder layer's projection (an adapted "
                             f"embedding, head or bias is not served)")
        layer, part, module, which = int(match.group(1)), match.group(2), match.group(3), match.group(4)
        if module not in MODULES or MODULES[module][0] != part:
            raise ValueError(f"{where}: {key} adapts {part}.{module}; served: {sorted(MODULES)}")
        if own_layer is not None:
            if layer not in own_layer:
                continue  # a layer of the target that this draft does not run
            layer = own_layer[layer]
        elif not 0 <= layer < count:
            raise ValueError(f"{where}: {key} is layer {layer}; the model at hand has {count} layers")
        found.setdefault((layer, module), {})[which] = tensor.t() if fan_in_fan_out else tensor
    weights = {}
    dtype, device = next(model.parameters()).dtype, model.device
    dtype = dtype if dtype.is_floating_point else torch.float32
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        inputs, outputs = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, inputs) or b.shape != (outputs, rank):
            raise ValueError(f"{where}: layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                             f"the model's {module} takes {inputs} and gives {outputs} features (r={rank}): the "
                             "adapter was trained for another model")
        weights[(layer, module)] = (a.to(device=device, dtype=dtype).contiguous(),
                                    (b.double() * scale).to(device=device, dtype=dtype).contiguous())
    if not weights and layers is None:
        raise ValueError(f"{where}: no LoRA weights")
    return Adapter(name, str(directory), rank, weights)


def save_adapter(path: str | Path, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], rank: int,
                 alpha: float, base_model: str = "") -> None:
    """Write PEFT's layout: weights per (layer, module) as (A (r, in), B (out, r)), unscaled (tests, tools)."""
    from safetensors.torch import save_file
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{MODULES[module][0]}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(directory / WEIGHTS[0]))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "task_type": "CAUSAL_LM",
              "target_modules": sorted({module for _, module in weights}), "base_model_name_or_path": base_model}
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def random_adapter(model, rank: int = 4, seed: int = 0, modules: tuple[str, ...] = tuple(MODULES),
                   std: float = 0.1) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA adapter's weights for `model` drawn from a seed, large enough to change its greedy output
    (tests, the tiny pair's adapters): every layer's `modules`."""
    generator = torch.Generator().manual_seed(seed)
    shapes, out = _shapes(model), {}
    for layer in range(len(model.model.layers)):
        for module in modules:
            inputs, outputs = shapes[module]
            out[(layer, module)] = (torch.randn(rank, inputs, generator=generator, dtype=torch.float64) * std,
                                    torch.randn(outputs, rank, generator=generator, dtype=torch.float64) * std)
    return out


class AdapterSet:
    """The adapters a model serves, by slot (1, 2, ...; 0 is the base model), laid out per layer and product
    group for the forward: A (S R, in) and B transposed (S R, out), slot s's ranks at rows [(s - 1) R, s R) of
    both (R the group's ranks side by side, zeros where an adapter has fewer or leaves a module alone; B
    transposed so that a slot's rows are contiguous, what a CPU's small products want).

    `adapters` hold the first slots for good. With a `directory` (vLLM's LoRA resolver, SGLang's
    --max-loaded-loras), an adapter a request names that is not held is read from DIRECTORY/NAME into a free
    slot, or into the least recently used one whose adapter no running sequence runs: `slots` in all (0:
    lora_config.slot_count's), each of rank up to `rank` (0: the adapters' largest, at least DIRECTORY_RANK
    with a directory). The tensors keep their shapes: a CUDA graph's
    captured products read them in place. A slot's `key` is new at every load: a prefix cache keyed by it
    never serves one adapter's blocks to another that took the slot later. A held directory adapter whose
    entry changed since it was read (its link pointed elsewhere, its files rewritten: the gateway's
    load_lora_adapter with load_inplace) is read again for the next sequence that names it, into another slot
    while running sequences still run the earlier version; one whose entry is gone is refused."""

    def __init__(self, model, adapters: list[Adapter], slots: int = 0, rank: int = 0, directory: str = "",
                 layers: tuple[int, ...] | None = None):
        names = [adapter.name for adapter in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapters named twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        largest = max((adapter.rank for adapter in adapters), default=0)
        self.rank = rank = rank or max(largest, DIRECTORY_RANK if directory else 0)
        if largest > rank:
            raise ValueError(f"LoRA adapter {max(adapters, key=lambda a: a.rank).name!r} has rank {largest}; "
                             f"max_lora_rank is {rank}")
        capacity = slot_count(slots, len(adapters), directory)
        if capacity < len(adapters) or (directory and capacity <= len(adapters)):
            raise ValueError(f"max_loras={capacity} holds {'no adapter of lora_directory beside ' if directory else ''}"
                             f"the {len(adapters)} of lora_adapters")
        self.directory = directory
        self.model, self.layers = model, layers  # layers: load_adapter's (a draft's map onto the target's)
        self.slots: list[str | None] = names + [None] * (capacity - len(adapters))  # slot s's adapter at s - 1
        self.pinned = len(adapters)  # lora_adapters' slots: never taken over
        self.keys = list(range(1, capacity + 1))  # slot s's key at s - 1 (`key`)
        self.stamps: list[tuple | None] = [None] * capacity  # a directory adapter's files as read (`_stamp`)
        self._next_key = capacity + 1
        self._used = list(range(capacity))  # slot indices, least recently used first
        self.loads = 0  # adapters read from the directory (what the server's metrics count)
        self._shapes = shapes = _shapes(model)
        dtype, device = next(model.parameters()).dtype, model.device
        self.dtype = dtype = dtype if dtype.is_floating_point else torch.float32
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = []
        for layer in range(len(model.model.layers)):
            groups = {}
            for group, modules in GROUPS.items():
                if not directory and not any((layer, m) in a.weights for a in adapters for m in modules):
                    continue  # no adapter touches it (nor can a later one): nothing to add
                inputs, outs = shapes[modules[0]][0], [shapes[m][1] for m in modules]
                width = rank * len(modules)  # a slot's columns
                groups[group] = (torch.zeros(capacity * width, inputs, dtype=dtype, device=device),
                                 torch.zeros(capacity * width, sum(outs), dtype=dtype, device=device), width)
            self.stacks.append(groups)
        for index, adapter in enumerate(adapters):
            self._write(index, adapter)
        self.bytes = sum(t.nbytes for groups in self.stacks for entry in groups.values() for t in entry[:2])
        self.widths = {entry[2] for groups in self.stacks for entry in groups.values()}  # a slot's columns, per group

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters held now."""
        return tuple(name for name in self.slots if name is not None)

    def _write(self, index: int, adapter: Adapter) -> None:
        """Slot index + 1 takes `adapter`'s matrices (in place; zeros where it leaves a module alone)."""
        outs_of = {module: self._shapes[module][1] for module in MODULES}
        for layer, groups in enumerate(self.stacks):
            for group, (a_flat, b_t, width) in groups.items():
                first = index * width
                a_flat[first:first + width].zero_()
                b_t[first:first + width].zero_()
                row = 0
                for j, module in enumerate(GROUPS[group]):
                    pair = adapter.weights.get((layer, module))
                    column = first + j * self.rank
                    if pair is not None:
                        a, b = pair
                        a_flat[column:column + a.shape[0]].copy_(a)
                        b_t[column:column + b.shape[1], row:row + outs_of[module]].copy_(b.t())
                    row += outs_of[module]

    def problem(self, name: str) -> str | None:
        """Why a request may not run adapter `name` (not held, and not in the directory), or None. (Asked at
        every round of a request: one whose adapter left the directory while it ran runs on with it;
        `acquire`, at a sequence's first step, refuses it.)"""
        if not name or name in self.slots or directory_adapter(self.directory, name) is not None:
            return None
        where = f"; none in lora_directory {self.directory}" if self.directory else ""
        return f"no LoRA adapter {name!r} (served: {', '.join(self.names) or 'none'}{where})"

    def acquire(self, name: str, busy: set[int]) -> int:
        """The slot of adapter `name` ("": the base model, 0), read from the directory if it is not held (the
        least recently used slot whose adapter no slot in `busy` runs makes room); it becomes the most
        recently used. ValueError: no such adapter, or one that does not fit the model; CapacityError: every
        slot runs a sequence's adapter."""
        if not name:
            return 0
        path = None
        if name in self.slots and self.slots.index(name) >= self.pinned:  # read from the directory: still so?
            index = self.slots.index(name)
            path = directory_adapter(self.directory, name)
            if _stamp(path) != self.stamps[index]:
                self.slots[index] = None  # out of date (its running sequences keep its matrices: a busy slot)
        if name in self.slots:
            index = self.slots.index(name)
        else:
            path = path or directory_adapter(self.directory, name)
            if path is None:
                raise ValueError(self.problem(name))
            free = [i for i in self._used if i >= self.pinned and i + 1 not in busy]
            if not free:
                raise CapacityError(f"LoRA adapter {name!r}: each of the {len(self.slots)} LoRA slots (max_loras) "
                                    "holds an adapter a running request runs; retry later")
            stamp = _stamp(path)  # before the read: files changed during it are read again next time
            adapter = load_adapter(name, path, self.model, self.layers)
            if adapter.rank > self.rank:
                raise ValueError(f"LoRA adapter {name!r} ({adapter.path}) has rank {adapter.rank}; max_lora_rank is "
                                 f"{self.rank}")
            index = free[0]
            self._write(index, adapter)
            self.slots[index], self.keys[index], self.stamps[index] = name, self._next_key, stamp
            self._next_key += 1
            self.loads += 1
        self._used.remove(index)
        self._used.append(index)
        return index + 1

    def key(self, slot: int) -> int:
        """What tells apart the keys and values of slot's adapter from every other's, the base model's (0)
        and those of an adapter the slot held before (new at every load)."""
        return self.keys[slot - 1] if slot else 0

    def plan(self, slots: torch.Tensor) -> "Plan | None":
        """How a forward's rows (slots (N,), each row's adapter) take their adapters' products: None where
        every row is the base model's (nothing to add)."""
        capturing = slots.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        count = len(self.slots)
        if not capturing:
            present = set(slots.tolist())  # eagerly the host knows which adapters the rows run
            if present == {0}:
                return None
            if len(present) == 1:  # one adapter for every row: its own matrices, nothing masked
                return Plan(slots, present.pop(), {}, 0)
            count = max(present)  # the slots up to the last one a row runs (slots fill from the first)
        # Rows of several adapters, or of data the host does not read (a graph captured): every adapter's
        # product for every row, each row keeping its own adapter's columns (masks made once a forward)
        columns = torch.arange(1, count + 1, device=slots.device)
        masks = {width: (columns.repeat_interleave(width) == slots[:, None]).to(self.dtype) for width in self.widths}
        return Plan(slots, 0, masks, count)

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, plan: "Plan") -> torch.Tensor:
        """y (N, out), the base model's `group` product of x (N, in) in `layer`, plus what the rows' adapters add
        (in place)."""
        entry = self.stacks[layer].get(group)
        if entry is None:
            return y
        a_flat, b_t, width = entry
        if plan.slot:  # every row runs this one adapter
            first = (plan.slot - 1) * width
            return y.addmm_(torch.nn.functional.linear(x, a_flat[first:first + width]), b_t[first:first + width])
        end = plan.count * width  # the slots the plan runs
        low = torch.nn.functional.linear(x, a_flat[:end]).mul_(plan.masks[width])  # (N, S R): the row's own columns
        return y.addmm_(low, b_t[:end])


def _stamp(path: Path | None) -> tuple | None:
    """What tells a directory adapter's files from a later version of them: where its entry links to, and
    each file's modification time and size; None: no adapter there. (os calls: a new sequence pays it.)"""
    if path is None:
        return None
    try:
        out: list = [os.readlink(path)]
    except OSError:  # a folder of its own, not a link
        out = [""]
    for name in (CONFIG, *WEIGHTS):
        try:
            info = os.stat(os.path.join(path, name))
            out.append((info.st_mtime_ns, info.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


class Plan(NamedTuple):
    """A forward's rows and how they take their adapters (`AdapterSet.plan`)."""

    slots: torch.Tensor  # (N,) each row's adapter
    slot: int  # > 0: every row runs this adapter; 0: masks
    masks: dict[int, torch.Tensor]  # per slot width: (N, count width), 1 at a row's own adapter's columns
    count: int  # with masks: the first `count` slots' products run (eagerly up to the last a row runs; all in a graph)


def load_adapters(model, adapters: dict[str, str], slots: int = 0, rank: int = 0,
                  directory: str = "", layers: tuple[int, ...] | None = None) -> AdapterSet | None:
    """`AdapterSet` of {name: path} (held for good), with room for `slots` in all of rank up to `rank` and
    adapters read on demand from `directory` (`AdapterSet`); None for none. `layers`: `load_adapter`'s."""
    if not adapters and not directory:
        return None
    return AdapterSet(model, [load_adapter(name, path, model, layers) for name, path in adapters.items()], slots,
                      rank, directory, layers)
