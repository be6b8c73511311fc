"""The static forward: forwards of a few fixed shapes over the paged KV store, captured once (CUDA graphs
on the GPU) and replayed.

transformers' own forward lets Python decide every shape; on a GPU the host then spends longer launching
kernels than the GPU spends running them. Here nothing in a decode or verify forward changes shape from
one step to the next:

- A forward's inputs are tensors of a bucketed shape: (B sequences, T rows each) token ids and
  positions, where each row's key and value go (block, offset), each sequence's block table (B, W /
  block_size) and how many keys each row may see. Attention gathers a sequence's blocks into a window
  of W keys (W bucketed too) and masks by those counts, so lengths are data, not shapes.
- Each (B, T, W) bucket is captured once as a CUDA graph (`compile="graphs"`, the default on CUDA) and
  replayed: one launch per forward instead of hundreds. `compile="off"` runs the same forward eagerly
  (the reference the tests compare against). Prompts of up to `prefill_rows` rows run alone in buckets
  of their own; longer ones run eagerly with their own shapes; more than B sequences run as several
  forwards.
- The model's math is `llama_forward.LlamaForward`; with `fuse_kernels` its pointwise work runs through
  compiled kernels (`kernels.py`). The whole forward is not compiled: CUDA graphs already remove the
  launches, and compiling it would tie every bucket to a compile of its own.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import numpy as np
import torch

from specdec import tensor_names as tn
from specdec.engine import kernels
from specdec.engine.cuda_graphs import CapturedForward, InputStaging
from specdec.engine.interfaces import ForwardOutput
from specdec.engine.llama_forward import MAX_TREE_ROWS, Batch, LlamaForward, ancestor_bits
from specdec.engine.kv_cache import tree_depths
from specdec.engine.paged_kv import PagedKV, PagedSequence

COMPILE_MODES = tn.COMPILE_MODES
CAPTURE_RESERVE_BYTES = 2 << 30  # capturing at load stops when less is free: room for eager prompts
# What one more eager forward on a CPU costs, in padded rows (its weights streamed once more, its calls): a
# batch's sequences split where padding every one to the longest would cost more. The default pair's target
# on a 2-core EPYC: 2-3.5 rows (a row 2.2 ms, 8 sequences of one row 22.6 ms; results/2026-12-04-cpu-batched-drafts)
EAGER_FORWARD_ROWS = 4


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit`: the sizes a dimension is padded up to."""
    out = [1 << i for i in range(max(limit - 1, 0).bit_length()) if (1 << i) < limit]
    return out + [limit]


def bucket(value: int, sizes: list[int]) -> int | None:
    return next((size for size in sizes if size >= value), None)


def padded_groups(counts: dict[int, int], most: int, fixed_rows: float) -> list[list[int]]:
    """Sequences {index: rows} into forwards of at most `most` sequences, each forward's rows padded to its
    longest sequence's: the partition of the sequences sorted by rows that costs the least, a forward costing
    fixed_rows + its sequences x its longest (one sequence drafting 8 tokens among 7 plain steps: 72 rows in
    one forward, 16 and one more forward split)."""
    order = sorted(counts, key=lambda i: counts[i])
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(max(0, end - most), end):
            cost = best[start] + fixed_rows + (end - start) * counts[order[end - 1]]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


class StaticForward:
    """Runs `LlamaForward` over the store's pool in bucketed shapes, captured or eagerly.

    max_batch / max_rows: the largest bucket of sequences per forward and rows per sequence (verify
    forwards are K + 1 rows); min_window: the smallest bucket of keys attended over. compile: "graphs"
    (CUDA only), "off" (eager), "auto" (graphs on CUDA). fuse_kernels: the pointwise work compiled into
    fused kernels; None: with CUDA graphs. fuse_mlp: a SiLU MLP's gate and up projections as one product;
    None: with CUDA graphs. prefill_rows: prompts of up to this many rows (beyond max_rows) run alone in
    buckets of their own, powers of two, padded, their head on the rows wanted only: captured like the
    others where graphs run (an eager prompt pays a launch per kernel); 0: every longer prompt runs
    eagerly. hidden_layers: a forward also returns the residual stream after these layers at every new
    position (captured with the rest). Rows may be trees (`Step.tree`) of up to max_rows nodes (and
    MAX_TREE_ROWS): they run in the decode buckets, each node at the position after its parent's, seeing
    the cache and its ancestors (`llama_forward.attention_mask`), its key and value written at the slot of
    its row. attention: tn.ATTENTION_KINDS (`LlamaForward`'s)."""

    def __init__(self, model, kv: PagedKV, max_batch: int = 8, max_rows: int = 17, compile: str = "auto",
                 min_window: int = 128, fuse_kernels: bool | None = None, fuse_mlp: bool | None = None,
                 prefill_rows: int = 0, log: Callable[[str], None] = lambda message: None,
                 hidden_layers: tuple[int, ...] = (), skip: tuple[int, ...] = (), attention: str = "auto",
                 adapters=None, graph_skip: tuple[int, ...] | None = None):
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        self.device = device = model.device
        self.mode = self.mode_for(compile, device)
        if self.mode == "graphs" and device.type != "cuda":
            raise ValueError("compile=graphs needs a CUDA device")
        self.pool, self.log = kv.pool, log
        layers = len(model.model.layers)
        if any(not 0 <= layer < layers for layer in hidden_layers):
            raise ValueError(f"hidden_layers {list(hidden_layers)} must be within [0, {layers}) (the model's layers)")
        self.hidden_layers = tuple(hidden_layers)
        # skip: a layer-skip self-draft with one set for its life (its graphs are captured with that set)
        # fuse_mlp None: fused with CUDA graphs, eagerly where fusing is exact (LlamaForward's None)
        self.llama = LlamaForward(model, self.pool, True if fuse_mlp is None and self.mode == "graphs" else fuse_mlp,
                                  self.hidden_layers, skip, attention, adapters)
        log(f"attention: {self.llama.attention}")
        if fuse_kernels or (fuse_kernels is None and self.mode == "graphs"):
            self.fuse()
        self.batch_sizes = buckets(max_batch)
        self.row_sizes = buckets(max_rows)
        # A prompt's buckets (one sequence): powers of two above the row buckets, then prefill_rows.
        self.prefill_sizes = [size for size in buckets(prefill_rows) if size > max_rows] if prefill_rows > max_rows else []
        self.head_rows = max_rows  # the logits a prompt's bucket returns (its first call's K + 1 at most)
        self.max_tree_rows = min(max_rows, MAX_TREE_ROWS)  # a tree runs in a decode bucket
        # Windows of keys: min_window tokens doubling up to the context (in blocks).
        block_size = self.pool.block_size
        smallest = max(1, min_window // block_size)
        top = -(-kv.max_context // block_size)
        self.window_sizes = sorted({min(smallest << i, top) for i in range(max(top // smallest, 1).bit_length() + 1)})
        self.captured: dict[tuple[int, int, int], CapturedForward] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.mode == "graphs" else None
        self._uncapturable: set[tuple[int, int, int]] = set()
        self._capture_stream = torch.cuda.Stream(device) if self.mode == "graphs" else None
        # A layer-skip self-draft whose set is searched (skip_layers.LayerSkipForward over this forward, every
        # layer built): the set its graphs run, captured for it; groups of sequences on another set run
        # eagerly (`skipping`). `retarget` moves the graphs to a new set. None: the graphs run every layer
        # this forward was built with.
        self.graph_skip = None if graph_skip is None else tuple(graph_skip)
        self._set: tuple[int, ...] | None = None  # the set `skipping` runs now (None: outside it)
        self.staging = InputStaging(device)
        if self.mode == "graphs" and self.llama.attention == "sdpa":
            self.llama.reserve_workspace(self.batch_sizes[-1] * self.window_sizes[-1])

    def fuse(self) -> None:
        """Run the pointwise work through compiled kernels, compiled now: forwards of 1 and of 3 rows,
        under no_grad (what captures run in) and inference_mode (eager prompts), every write going to the
        scratch block, so that nothing compiles later, while a CUDA graph is captured. If compiling
        fails (no inductor backend for the device, no compiler) the eager kernels stay, logged: slower,
        same results."""
        started, (compiled, loaded) = time.perf_counter(), kernels.cache_counts()
        self.llama.kernels = kernels.compiled()
        try:
            for mode in (torch.no_grad, torch.inference_mode):
                for rows in (1, 3):
                    with mode():
                        flat = torch.zeros(Batch.size(1, rows, 1), dtype=torch.long, device=self.device)
                        batch = Batch.view(flat, 1, rows, 1)
                        batch.clear(self.pool.scratch)
                        self.llama(batch)
        except Exception as error:  # noqa: BLE001: any compiler failure leaves the eager path, which works
            self.llama.kernels = kernels.EAGER
            self.log(f"fused kernels: torch.compile failed ({type(error).__name__}: {error}); eager kernels")
            return
        compiled, loaded = (now - before for now, before in zip(kernels.cache_counts(), (compiled, loaded)))
        self.log(f"fused kernels: ready in {time.perf_counter() - started:.1f} s ({compiled} compiled, {loaded} "
                 f"loaded; inductor's cache {kernels.cache_location()})")

    def summary(self, ready: int, seconds: float) -> str:
        if self.mode == "off":
            return "static executor, eager (compile=off)"
        held = "" if self.graph_skip is None else f" for the skipped layers {list(self.graph_skip)}"
        return (f"static executor: {ready} of {len(self.bucket_shapes())} shape buckets captured as CUDA graphs"
                f"{held} in {seconds:.1f} s (the rest on first use)"
                f"{'; MLP gate/up products fused' if any(self.llama.gate_up) else ''}")

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (sequences, rows, key blocks) bucket, in the order warm_up captures them: smallest windows
        first, then a prompt's buckets in the windows that can hold the prompt."""
        shapes = [(b, t, w) for w in self.window_sizes for b in self.batch_sizes for t in self.row_sizes]
        return shapes + [(1, t, w) for w in self.window_sizes for t in self.prefill_sizes
                         if w * self.pool.block_size >= t]

    def warm_up(self, time_budget_s: float = 120.0) -> tuple[int, float]:
        """Capture every bucket until the time budget is spent; the rest are captured on first use.
        Returns (buckets ready, seconds)."""
        started = time.perf_counter()
        if self.mode == "off":
            return 0, 0.0
        # This process's allocator, not the device's free memory (another model loading on the same GPU
        # at the same time would count too), without its cached free blocks (eager forwards leave some).
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        held = self.skipping(self.graph_skip) if self.graph_skip is not None else contextlib.nullcontext()
        with held:  # a searched layer-skip draft's graphs run its set
            for shape in self.bucket_shapes():
                if time.perf_counter() - started > time_budget_s or self._captured(shape) is None:
                    break
        torch.cuda.empty_cache()
        self.log(f"{len(self.captured)} CUDA graphs captured, taking "
                 f"{(torch.cuda.memory_reserved(self.device) - reserved_before) / 2**30:.2f} GiB of device memory")
        return len(self.captured), time.perf_counter() - started

    @torch.no_grad()
    def _captured(self, shape: tuple[int, int, int]) -> CapturedForward | None:
        """The bucket's graph, captured now if need be; None if the device has no memory left for it
        (that bucket, and larger ones, then run eagerly: slower, still correct)."""
        if shape in self.captured:
            return self.captured[shape]
        if shape in self._uncapturable:
            return None
        if self.device.type == "cuda" and torch.cuda.mem_get_info(self.device)[0] < CAPTURE_RESERVE_BYTES:
            if not self._uncapturable:
                self.log(f"less than {CAPTURE_RESERVE_BYTES >> 20} MiB free on {self.device}: no more CUDA graphs "
                         f"are captured (that much stays free for eager prompts); uncaptured buckets run eagerly")
            self._uncapturable.add(shape)
            return None
        try:
            forward = self.captured[shape] = self._capture(shape)
        except torch.cuda.OutOfMemoryError:
            self._uncapturable.add(shape)
            torch.cuda.empty_cache()
            self.log(f"no GPU memory left to capture the bucket {shape} (sequences, rows, key blocks): it runs "
                     f"eagerly; lower kv_memory_fraction or kv_pool_tokens to leave room")
            return None
        return forward

    def _capture(self, shape: tuple[int, int, int]) -> CapturedForward:
        """The bucket's forward captured now, as the layers run now."""
        return CapturedForward(self.llama, shape, self.pool.scratch, self.device, self._graph_pool,
                               self._capture_stream, head_rows=self.head_rows if shape[1] > self.row_sizes[-1] else 0)

    @staticmethod
    def mode_for(compile: str, device: torch.device) -> str:
        """What a `compile` setting means on `device`: "graphs" (CUDA graphs) or "off" (eager)."""
        return ("graphs" if device.type == "cuda" else "off") if compile == "auto" else compile

    @contextlib.contextmanager
    def skipping(self, skip: tuple[int, ...]):
        """Forwards inside run without the layers in `skip` (a layer-skip self-draft whose set may change,
        skip_layers.LayerSkipForward). With graphs, only a forward built for that (graph_skip set): they
        replay where `skip` is the set the graphs hold, else run eagerly (a captured graph runs the set it
        was captured with)."""
        if self.mode == "graphs" and self.graph_skip is None:
            raise ValueError("a layer-skip draft's set changes only eagerly (compile off) or where its search "
                             "holds graphs for one set at a time (graph_skip): graphs hold theirs")
        every, was = self.llama.run_layers, self._set
        self.llama.run_layers = tuple(i for i in range(len(self.llama.body.layers)) if i not in set(skip))
        self._set = tuple(skip)
        try:
            yield
        finally:
            self.llama.run_layers, self._set = every, was

    def retarget(self, skip: tuple[int, ...]) -> None:
        """A searched layer-skip draft's graphs move to the set `skip`: the ones held go (their memory with
        them), and each bucket is captured again on its first use by a sequence on that set."""
        if self.graph_skip is None or tuple(skip) == self.graph_skip:
            return
        self.captured.clear()
        self._uncapturable.clear()
        if self.mode == "graphs" and self.device.type == "cuda":
            self._graph_pool = torch.cuda.graph_pool_handle()
            torch.cuda.empty_cache()
        self.graph_skip = tuple(skip)
        self.log(f"CUDA graphs now for the skipped layers {list(self.graph_skip)}: captured on first use")

    def _replays(self) -> bool:
        """Whether this forward's graphs run the layers running now."""
        return self.mode != "off" and (self.graph_skip is None or self._set == self.graph_skip)

    def __call__(self, seqs: list[PagedSequence], rows: list, num_logits: list[int],
                 trees: list | None = None) -> ForwardOutput:
        """One forward per group of at most max_batch sequences whose new rows fit the row buckets (run
        eagerly on a CPU, the groups that pad the fewest rows: `padded_groups`); a longer one (a prompt)
        runs alone. Same contract as `TransformersForward.__call__`."""
        trees = trees or [None] * len(seqs)
        if any(tree is not None and len(tree) > self.max_tree_rows for tree in trees):
            raise ValueError(f"a tree of more than {self.max_tree_rows} nodes (max_rows, at most {MAX_TREE_ROWS})")
        order = list(range(len(seqs)))
        long = [i for i in order if len(rows[i]) > self.row_sizes[-1]]
        short = [i for i in order if len(rows[i]) <= self.row_sizes[-1]]
        most = self.batch_sizes[-1]
        if self.device.type == "cpu" and not self._replays():  # eager on a CPU: a padded row costs a row
            groups = [[i] for i in long] + padded_groups({i: len(rows[i]) for i in short}, most, EAGER_FORWARD_ROWS)
        else:  # a GPU's buckets pad anyway, and its rows are nearly free: the fewest forwards
            groups = [[i] for i in long] + [short[j:j + most] for j in range(0, len(short), most)]
        logits: list = [None] * len(seqs)
        hidden: list | None = [None] * len(seqs) if self.hidden_layers else None
        for group in groups:
            out = self._forward_group([seqs[i] for i in group], [rows[i] for i in group],
                                      [num_logits[i] for i in group], [trees[i] for i in group])
            for j, i in enumerate(group):
                logits[i] = out.logits[j]
                if hidden is not None:
                    hidden[i] = out.hidden[j]
        return ForwardOutput(logits, hidden)

    def _forward_group(self, seqs: list[PagedSequence], rows: list, num_logits: list[int],
                       trees: list) -> ForwardOutput:
        counts = [len(row) for row in rows]
        block_size = self.pool.block_size
        batch = bucket(len(seqs), self.batch_sizes)
        width = bucket(max(counts), self.row_sizes)
        needed_blocks = max(-(-(seq.length + count) // block_size) for seq, count in zip(seqs, counts))
        window = bucket(needed_blocks, self.window_sizes)
        # A prompt (rows beyond the row buckets) in a prompt bucket of its own: the head on its wanted rows.
        prompt = width is None and len(seqs) == 1 and num_logits[0] <= self.head_rows
        if prompt:
            width = bucket(counts[0], self.prefill_sizes)
        bucketed = width is not None and batch is not None and self._replays()
        if not bucketed:  # a prompt, or any forward run eagerly: its own shape (padding would only cost)
            batch, width, window = len(seqs), max(counts), needed_blocks
        # Every input, and the indices of the rows wanted, in one host buffer and one copy.
        wanted = [b * width + j for b, (count, n) in enumerate(zip(counts, num_logits)) for j in range(count - n, count)]
        head = len(wanted) if not (prompt and bucketed) else self.head_rows  # a bucket's: padded (row 0)
        wanted += [0] * (head - len(wanted))
        size = Batch.size(batch, width, window)
        flat = self.staging.host(size + len(wanted))
        host = Batch.view(flat, batch, width, window)
        host.clear(self.pool.scratch)
        on_device = []
        for b, (seq, row, count, tree) in enumerate(zip(seqs, rows, counts, trees)):
            where = seq.length + np.arange(count)  # the slots the rows' keys and values go to
            if isinstance(row, torch.Tensor):
                on_device.append((b, row))
            else:
                host.ids[b, :count] = row
            # The blocks this forward reaches (a sequence holds its whole reservation from its start).
            blocks = np.asarray(seq.blocks[:window], dtype=np.int64)
            host.write_block[b, :count] = blocks[where // block_size]
            host.write_offset[b, :count] = where % block_size
            host.table[b, :len(blocks)] = blocks
            if tree is None:
                host.positions[b, :count] = where
                host.visible[b, :count] = where + 1
            else:  # a node sits after its parent, sees the cache and (ancestors) its own path
                host.positions[b, :count] = seq.length + np.asarray(tree_depths(tree))
                host.visible[b, :count] = seq.length
                host.ancestors[b, :count] = ancestor_bits(tree)
            host.positions[b, count:] = seq.length + count - 1  # padding rows: any valid position
            host.adapter[b, :count] = seq.adapter
        flat[size:] = wanted
        captured = self._captured((batch, width, window)) if bucketed and self.mode != "off" else None
        device_flat = self.staging.send(size + len(wanted), captured.flat if captured is not None else None)
        inputs = Batch.view(device_flat, batch, width, window)
        for b, row in on_device:  # drafted tokens stay on the device
            inputs.ids[b, :len(row)] = row
        rows_wanted = device_flat[size:size + len(wanted)]
        if width > self.row_sizes[-1] or not bucketed:  # the head on the wanted rows only, in their order
            out = captured.run() if captured is not None else self.llama(inputs, rows_wanted)
            # Copied: a captured output is overwritten by the next run.
            logits = (out[0] if self.hidden_layers else out)[:sum(num_logits)].clone()
        else:
            out = captured.run() if captured is not None else self.llama(inputs)
            # The wanted rows, gathered into new tensors (a captured output is overwritten by the next run).
            logits = (out[0] if self.hidden_layers else out).flatten(0, 1)[rows_wanted]
        hidden = None
        if self.hidden_layers:  # every new row's (B, T, L, H), gathered: a captured output is overwritten
            hidden = [out[1][b, :count].clone() for b, count in enumerate(counts)]
        return ForwardOutput(list(torch.split(logits, num_logits)), hidden)
