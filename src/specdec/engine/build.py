"""Building an executor: which KV store and which forward serve a model, from one configuration.

  dynamic  `kv_cache.ContiguousKV` + `TransformersForward`: any architecture transformers runs, any
           device, a model spread over GPUs; memory grows on demand
  static   `paged_kv.PagedKV` + `StaticForward`: the Llama family on one device, a KV pool allocated at
           load, forwards in bucketed shapes replayed as CUDA graphs

`build_executor` makes the choice the adapters and benchmarks share: "auto" takes the static executor
where the model allows it and it pays: on a GPU (CUDA graphs: kernel launches dominate eager steps), and
on the CPU for a float32 model where this project's CPU kernels build (kernels.cpu(): a layer's pointwise
work and attention one call each, reading the pool in place; transformers' eager forward spends more of
a step dispatching small operations than multiplying). Elsewhere the dynamic one. A layer-skip draft
whose set may change (its search, `skip_search`) keeps a set per sequence: on the CPU's kernels the static
forward eagerly, else transformers' forward; with CUDA graphs the static forward's graphs run the set the
search holds best (`StaticForward.retarget`), sequences on an older set eagerly. A set given runs in the
static forward's graphs for life.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec import tensor_names as tn
from specdec.engine import kernels, lora, onednn_linear, panel_linear
from specdec.engine.executor import Executor
from specdec.engine.kv_cache import ContiguousKV
from specdec.engine.llama_forward import supports
from specdec.engine.paged_kv import PagedKV
from specdec.engine.skip_layers import LayerSkipForward, check_skip
from specdec.engine.static_forward import StaticForward
from specdec.engine.transformers_forward import TransformersForward


@dataclass(frozen=True)
class ExecutorConfig:
    """Every setting an executor takes; the model configs' parameters of the same names set them."""

    executor: str = "auto"  # tn.EXECUTORS: auto, static, dynamic
    compile: str = "auto"  # tn.COMPILE_MODES: auto (CUDA graphs on a GPU), off, graphs
    max_sequences: int = 256  # live sequences at once
    idle_timeout_s: float = 600.0  # a sequence unused this long is evicted (no release call came)
    prefix_caching: bool = True  # prompts reuse the KV blocks of earlier prompts that began alike
    block_size: int = 32  # tokens per KV block (the prefix cache's unit; the paged pool's)
    hidden_layers: tuple[int, ...] = ()  # layers whose output a forward also returns (a trained draft's input)
    # A layer-skip self-draft (skip_layers.py): these intermediate layers do not run. None: every layer runs.
    # Eagerly the set may change (for sequences that start later); with CUDA graphs it is kept for life,
    # unless skip_search: then the graphs follow the set the search chose (StaticForward.retarget).
    skip_layers: tuple[int, ...] | None = None
    skip_search: bool = False
    # dynamic
    # the prefix cache's store of copied blocks; on a CPU also the static pool's cap on cached unheld blocks
    prefix_cache_tokens: int = 4096
    # pad 2..n-1-row forwards to n (None: as `linear_kernels: auto` timed it at load; without that timing 4 on
    # CPU with torch's own linear kernels, whose 2-3-row GEMMs are slower than 4 rows in some BLAS builds;
    # oneDNN's reordered weights have no such cliff)
    min_forward_rows: int | None = None
    row_buckets: bool | None = None  # bound the row counts oneDNN sees (None: with oneDNN's linears)
    # static
    kv_pool_tokens: int = 0  # the pool's size; 0: max_sequences x max_context within kv_memory_fraction
    kv_memory_fraction: float = 0.4  # of the device's free memory at load, at most, for the pool
    max_context: int = tn.DEFAULT_MAX_CONTEXT_TOKENS
    max_batch: int = 16  # sequences per bucketed forward
    max_rows: int = tn.DEFAULT_MAX_NUM_DRAFT_TOKENS + 1  # rows per sequence in a bucket: K + 1
    fuse_kernels: bool = True  # where CUDA graphs run: pointwise work compiled into fused kernels
    fuse_mlp: bool = True  # where CUDA graphs run: a SiLU MLP's gate and up products as one
    prefill_graph_rows: int = tn.DEFAULT_PREFILL_GRAPH_ROWS  # with CUDA graphs: prompts up to this long captured
    min_window: int = 128  # the smallest bucket of keys attended over
    attention: str = "auto"  # tn.ATTENTION_KINDS: the paged kernel or a gathered window and SDPA
    # LoRA adapters served over the model (lora.py): (name, directory) pairs; the static executor only
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # a directory of adapters read on demand (DIRECTORY/NAME) into max_loras slots of rank up to max_lora_rank
    # (0: lora.AdapterSet's defaults)
    lora_directory: str = ""
    max_loras: int = 0
    max_lora_rank: int = 0
    # a draft made of some of the target's layers (a layer-skip draft model): the target's layer each of its
    # layers is, so that it runs a target's adapter on those (lora.load_adapter); None: the adapters' own model
    lora_layers: tuple[int, ...] | None = None


def dynamic_executor(model, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                     clock: Callable[[], float] = time.monotonic, min_forward_rows: int = 1,
                     row_buckets: bool = False, prefix_cache_tokens: int = 0, block_size: int = 32,
                     hidden_layers: tuple[int, ...] = (), skip_layers: tuple[int, ...] | None = None) -> Executor:
    """Transformers' forward over per-sequence KV buffers (see the module's docstring); with skip_layers,
    a layer-skip self-draft (`LayerSkipForward`: sequences may differ in their sets, so no prefix caching)."""
    forward = TransformersForward(model, min_forward_rows, row_buckets, hidden_layers)
    if skip_layers is not None:
        forward, prefix_cache_tokens = LayerSkipForward(forward, model, skip_layers), 0
    return Executor(model, ContiguousKV(model, prefix_cache_tokens, block_size), forward,
                    max_sequences=max_sequences, idle_timeout_s=idle_timeout_s, clock=clock)


def static_executor(model, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                    clock: Callable[[], float] = time.monotonic, kv_pool_tokens: int = 0, block_size: int = 32,
                    max_context: int = 8192, max_batch: int = 8, max_rows: int = 17, compile: str = "auto",
                    kv_memory_fraction: float = 0.4, min_window: int = 128, fuse_kernels: bool | None = None,
                    fuse_mlp: bool | None = None, prefix_caching: bool = True, prefill_rows: int = 0,
                    log: Callable[[str], None] = lambda message: None, hidden_layers: tuple[int, ...] = (),
                    skip_layers: tuple[int, ...] | None = None, attention: str = "auto",
                    lora_adapters: dict[str, str] | None = None, lora_directory: str = "", max_loras: int = 0,
                    max_lora_rank: int = 0, lora_layers: tuple[int, ...] | None = None,
                    skip_search: bool = False, prefix_cache_tokens: int | None = None) -> Executor:
    """The static Llama forward over a paged pool (see the module's docstring; the arguments are
    `PagedKV`'s and `StaticForward`'s). skip_layers, a layer-skip draft: captured with CUDA graphs, that
    set for life; eagerly `LayerSkipForward` over the static forward (a set per sequence, no prefix caching);
    with skip_search (its set searched), `LayerSkipForward` over graphs that follow the search's set.
    lora_adapters: {name: directory} of LoRA adapters a sequence may run (lora.py); lora_directory, one whose
    adapters are read on demand, max_loras slots of rank up to max_lora_rank (lora.AdapterSet); lora_layers, a
    draft's map onto the target's layers whose adapters it runs (lora.load_adapter)."""
    problem = supports(model)
    if problem:
        raise ValueError(f"the static executor cannot run this model: {problem}")
    if compile not in tn.COMPILE_MODES:  # before the pool is allocated
        raise ValueError(f"compile must be one of {tn.COMPILE_MODES}, got {compile!r}")
    layers = len(model.model.layers)
    skip = None if skip_layers is None else check_skip(tuple(skip_layers), layers)
    # before the pool takes its memory
    if lora_layers is not None and len(lora_layers) != layers:
        raise ValueError(f"lora_layers names {len(lora_layers)} of the target's layers; the model has {layers}")
    adapters = lora.load_adapters(model, dict(lora_adapters or {}), max_loras, max_lora_rank, lora_directory,
                                  lora_layers)
    eager = StaticForward.mode_for(compile, model.device) == "off"
    per_sequence = skip is not None and (eager or skip_search)
    kv = PagedKV(model, max_sequences, max_context, kv_pool_tokens, kv_memory_fraction, block_size,
                 prefix_caching and not per_sequence, log, prefix_cache_tokens)
    forward = StaticForward(model, kv, max_batch, max_rows, compile, min_window, fuse_kernels, fuse_mlp,
                            prefill_rows, log, hidden_layers, () if per_sequence or skip is None else skip, attention,
                            adapters, graph_skip=skip if per_sequence and not eager else None)
    if per_sequence:
        forward = LayerSkipForward(forward, model, skip)
    if adapters is not None:
        log(f"LoRA adapters: {', '.join(adapters.names) or 'none held'}; {len(adapters)} slots of rank {adapters.rank}"
            f"{', adapters of ' + lora_directory + ' read on demand' if lora_directory else ''} "
            f"({adapters.bytes / 2**20:.1f} MiB)")
    return Executor(model, kv, forward, max_sequences=max_sequences, idle_timeout_s=idle_timeout_s, clock=clock,
                    adapters=adapters)


def _wants_graphs(compile: str, device: torch.device) -> bool:
    return compile == "graphs" or (compile == "auto" and device.type == "cuda")


def plans_static(executor: str, compile: str, device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether `build_executor` takes the static executor for a model it can run (`supports`) on this device
    in this dtype: what a loader needs to know before the model exists (`llama_model.py`'s modules serve
    only the static executor)."""
    device = torch.device(device)
    cpu_kernels = device.type == "cpu" and kernels.cpu(device, dtype) is not None
    return executor == "static" or (executor == "auto" and (_wants_graphs(compile, device) or cpu_kernels))


def build_executor(model, config: ExecutorConfig, log: Callable[[str], None] = lambda message: None) -> Executor:
    """The executor `config` asks for over `model` (ValueError, saying why, for a choice the model or the
    device cannot take)."""
    unsupported = supports(model)
    if config.executor == "static" and unsupported:
        raise ValueError(f"executor=static cannot run this model: {unsupported}")
    wants_graphs = _wants_graphs(config.compile, model.device)
    if not unsupported and plans_static(config.executor, config.compile, model.device, next(model.parameters()).dtype):
        return static_executor(
            model, max_sequences=config.max_sequences, idle_timeout_s=config.idle_timeout_s,
            kv_pool_tokens=config.kv_pool_tokens, kv_memory_fraction=config.kv_memory_fraction,
            block_size=config.block_size, prefix_caching=config.prefix_caching, max_context=config.max_context,
            max_batch=config.max_batch, max_rows=config.max_rows, compile=config.compile,
            fuse_kernels=None if config.fuse_kernels else False, fuse_mlp=None if config.fuse_mlp else False,
            # eagerly, padding prompts into buckets would only cost
            prefill_rows=config.prefill_graph_rows if wants_graphs else 0, min_window=config.min_window, log=log,
            hidden_layers=config.hidden_layers, skip_layers=config.skip_layers, attention=config.attention,
            lora_adapters=dict(config.lora_adapters), lora_directory=config.lora_directory,
            max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, lora_layers=config.lora_layers,
            skip_search=config.skip_search,
            # On a CPU the pool's pages become resident as blocks are first used: prefixes cached in every block
            # the sequences leave free grow the process towards the pool's size (half the host's memory for a
            # target) under a mixed load, so the cache keeps to prefix_cache_tokens there, as the dynamic
            # executor's store does. A GPU's pool is resident from its allocation: caching costs nothing there.
            prefix_cache_tokens=config.prefix_cache_tokens if model.device.type == "cpu" else None)
    if config.lora_adapters or config.lora_directory:
        raise ValueError(f"LoRA adapters need the static executor (executor={config.executor}"
                         f"{': ' + unsupported if unsupported else ', which did not take it on this device and dtype'})")
    if config.compile == "graphs":
        raise ValueError(f"compile=graphs needs executor=static (got {config.executor}"
                         f"{', ' + unsupported if unsupported else ''})")
    kinds = {type(m) for m in model.modules()}
    prepacked = onednn_linear.PrepackedLinear in kinds  # oneDNN's kernels: row buckets bound their shapes
    min_rows = config.min_forward_rows
    if min_rows is None:  # as the loader's timing found (onednn_linear.choose), else the rule below
        min_rows = getattr(getattr(model, "linear_kernel_choice", None), "min_forward_rows", None)
    if min_rows is None:
        torchs = model.device.type == "cpu" and not prepacked and panel_linear.PanelLinear not in kinds
        min_rows = onednn_linear.TORCH_PADDED_ROWS if torchs else 1
    return dynamic_executor(
        model, max_sequences=config.max_sequences, idle_timeout_s=config.idle_timeout_s, min_forward_rows=min_rows,
        row_buckets=prepacked if config.row_buckets is None else config.row_buckets,
        prefix_cache_tokens=config.prefix_cache_tokens if config.prefix_caching else 0, block_size=config.block_size,
        hidden_layers=config.hidden_layers, skip_layers=config.skip_layers)
