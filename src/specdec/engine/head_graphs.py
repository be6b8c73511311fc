"""An EAGLE head's draft steps replayed as CUDA graphs: one-token chain steps, the fill of a round's
accepted positions and a tree's levels.

Eagerly, a head's step is a few dozen small kernels: on a GPU it costs their launches (about 1 ms on an
H200), not their work. Captured, it costs the work. A graph replays fixed memory, so the sequences' keys
and values live in one pool allocated at load, (slots, layers, capacity + scratch, kv_heads, D), a sequence's cache
being its slot's first `capacity` positions (draft_heads.HeadCache with fixed storage: the eager passes
write there too). A captured step takes m <= R rows from static tensors (tokens, hidden, rotary positions,
the columns their keys go to, and what each row sees: every column before `before`, and the columns
`base` + i for each bit i of `ancestors`, a tree's drafted entries), writes their keys and values in the
sequence's slot and attends over its first W columns; R the smallest row bucket holding m, W the smallest
window bucket past the last column written. One graph per (R, W), captured at load. Rows past m are
padding: they write to the slot's scratch columns (past the capacity, never read) and see column 0.

Without CUDA (the CPU tests) the same static-tensor steps run eagerly, into each bucket's own output tensors
as a replay writes them: what they compute, and a caller keeping outputs past the next step, are checked on a
CPU; what capture adds, on a GPU.
"""

from __future__ import annotations

import torch

from specdec.engine.draft_heads import EagleHead, HeadCache
from specdec.engine.head_kernels import ANCESTOR_BITS  # a row's tree entries past `base`: one int64's bits

ROW_BUCKETS = (1, 2, 4, 8, 16)  # a chain step; a fill or a tree level up to 16 rows (more run eagerly)


def window_sizes(capacity: int, smallest: int = 128) -> list[int]:
    """Powers of two from `smallest` up to the capacity (the last one the capacity itself)."""
    sizes, size = [], smallest
    while size < capacity:
        sizes.append(size)
        size *= 2
    return sizes + [capacity]


class HeadPool:
    """Every sequence's keys and values in a head's layers, allocated once; each slot has `scratch`
    columns past its capacity for a captured step's padding rows."""

    def __init__(self, head: EagleHead, slots: int, capacity: int, scratch: int = max(ROW_BUCKETS)):
        config = head.config
        parameter = next(head.parameters())
        shape = (slots, len(head.decoder_layers()), capacity + scratch, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
        self.values = torch.zeros_like(self.keys)
        self.capacity = capacity
        self.free = list(range(slots - 1, -1, -1))

    def cache(self) -> tuple[int, HeadCache] | None:
        """A free slot and a cache over its first `capacity` columns; None when every slot is taken."""
        if not self.free:
            return None
        slot = self.free.pop()
        return slot, HeadCache(self.keys[slot, :, :self.capacity], self.values[slot, :, :self.capacity])

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


# The rows of CapturedSteps.ints (one host-to-device copy a step); SCALARS holds the slot and the tree's base
TOKENS, POSITIONS, WRITES, BEFORE, ANCESTORS, SCALARS = range(6)


class CapturedSteps:
    """The head's step over m rows captured per (row bucket, window bucket): `run(...)` copies the inputs in,
    replays the buckets' graph and returns (hidden (m, h), logits (m, V)), valid until the next run."""

    def __init__(self, head: EagleHead, pool: HeadPool, smallest_window: int = 128,
                 rows: tuple[int, ...] = ROW_BUCKETS):
        self.head, self.pool = head, pool
        parameter = next(head.parameters())
        device = self.device = parameter.device
        self.rows = tuple(sorted(rows))
        most = self.rows[-1]
        self.ints = torch.zeros(6, max(most, 2), dtype=torch.long, device=device)
        self.hidden = torch.zeros(most, head.config.hidden_size, dtype=parameter.dtype, device=device)
        self.padding = torch.arange(pool.capacity, pool.capacity + most)  # the scratch columns
        self.windows = window_sizes(pool.capacity, smallest_window)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.pool_handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)

    @property
    def most_rows(self) -> int:
        return self.rows[-1]

    def _window(self, rows: int, size: int):
        pool, ints = self.pool, self.ints

        def attend(layer, k, v):  # (rows, kv, D) each: written at (slot, layer, writes); the first `size` read
            slot = ints[SCALARS, :1]
            layer_keys, layer_values = pool.keys.select(1, layer), pool.values.select(1, layer)  # views
            layer_keys.index_put_((slot.expand(rows), ints[WRITES, :rows]), k)
            layer_values.index_put_((slot.expand(rows), ints[WRITES, :rows]), v)
            keys = layer_keys.index_select(0, slot)[0, :size]
            values = layer_values.index_select(0, slot)[0, :size]
            columns = torch.arange(size, device=k.device)
            offset = columns - ints[SCALARS, 1]
            tree = (offset >= 0) & (offset < ANCESTOR_BITS)
            bits = (ints[ANCESTORS, :rows, None] >> offset.clamp(0, ANCESTOR_BITS - 1)[None]) & 1
            visible = (columns[None] < ints[BEFORE, :rows, None]) | (tree[None] & (bits == 1))  # (rows, size)
            return keys, values, visible
        return attend

    def _step(self, rows: int, size: int):
        return self.head.step(self.ints[TOKENS, :rows], self.hidden[:rows], self.ints[POSITIONS, :rows],
                              self._window(rows, size))

    def capture(self) -> None:
        """Every bucket's graph (a warm-up on a side stream first: lazy initialization must not be captured);
        without CUDA, the buckets are marked ready and run eagerly. Capturing writes slot 0's scratch
        columns only (the static inputs' padding)."""
        self._load(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                   torch.zeros(0, dtype=torch.long), 0, 0, 0)
        for rows in self.rows:
            for size in self.windows:
                if not self.cuda:  # the outputs a graph would keep, so a caller's reuse of them shows on a CPU too
                    self.graphs[rows, size] = (None, tuple(torch.empty_like(t) for t in self._step(rows, size)))
                    continue
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream), torch.inference_mode():
                    self._step(rows, size)
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool_handle, stream=self.stream), torch.inference_mode():
                    out = self._step(rows, size)
                self.graphs[rows, size] = (graph, out)

    def fits(self, rows: int, last_column: int) -> bool:
        """Whether a captured step takes `rows` rows writing up to `last_column` (else: eagerly)."""
        return bool(self.graphs) and rows <= self.most_rows and last_column < self.pool.capacity

    def _load(self, tokens, positions, before, ancestors, first: int, slot: int, base: int) -> None:
        m = len(positions)
        # pinned, copied without waiting (the caching host allocator keeps a buffer until its copy has run): the
        # host queues a chain's steps back to back as it did with kernels writing the inputs
        host = torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=self.cuda)
        host[POSITIONS, :m] = positions
        host[WRITES, :m] = torch.arange(first, first + m)
        host[WRITES, m:self.most_rows] = self.padding[m:]
        host[BEFORE, :m] = before
        host[BEFORE, m:self.most_rows] = 1  # padding rows see column 0: no row is fully masked
        host[ANCESTORS, :m] = ancestors
        host[SCALARS, :2] = torch.tensor([slot, base])
        if tokens.device.type == "cpu":
            host[TOKENS, :m] = tokens
        self.ints.copy_(host, non_blocking=True)
        if tokens.device.type != "cpu":  # a token drafted on the device stays there
            self.ints[TOKENS, :m].copy_(tokens)

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot: int, first: int,
            before: torch.Tensor, ancestors: torch.Tensor | None = None, base: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (m,), hidden (m, h), positions (m,) (host), their keys written at columns first..first+m-1
        of `slot`; row i sees every column before before[i] (host (m,)) and base + b for each bit b of
        ancestors[i] (host int64 (m,); none by default) -> (hidden (m, h), logits (m, V))."""
        m = len(positions)
        rows = next(rows for rows in self.rows if rows >= m)
        size = next(size for size in self.windows if size > first + m - 1)
        if ancestors is None:
            ancestors = torch.zeros(m, dtype=torch.long)
        self._load(tokens.reshape(-1), positions, before, ancestors, first, slot, base)
        self.hidden[:m].copy_(hidden.reshape(m, -1))
        graph, out = self.graphs[rows, size]
        if graph is None:  # uncaptured (no CUDA): into the bucket's own outputs, which a replay overwrites
            for kept, fresh in zip(out, self._step(rows, size)):
                kept.copy_(fresh)
        else:
            graph.replay()
        out_hidden, logits = out
        return out_hidden[:m], logits[:m]
