"""An EAGLE head's one-token draft step replayed as a CUDA graph.

Eagerly, a head's step is a few dozen small kernels: on a GPU it costs their launches (about 1 ms on an
H200), not their work. Captured, it costs the work. A graph replays fixed memory, so the sequences' keys
and values live in one pool allocated at load, (slots, capacity, kv_heads, D), a sequence's cache being
its slot's view (draft_heads.HeadCache with fixed storage: the eager passes over a round's features write
there too). A captured step reads its inputs from static tensors (token, hidden, position, slot), writes
its key and value at (slot, position) and attends over the first W positions of the slot, W the smallest
window bucket past the position; one graph per bucket, captured at load.
"""

from __future__ import annotations

import torch

from specdec.engine.draft_heads import EagleHead, HeadCache


def window_sizes(capacity: int, smallest: int = 128) -> list[int]:
    """Powers of two from `smallest` up to the capacity (the last one the capacity itself)."""
    sizes, size = [], smallest
    while size < capacity:
        sizes.append(size)
        size *= 2
    return sizes + [capacity]


class HeadPool:
    """Every sequence's keys and values of a head's one layer, allocated once."""

    def __init__(self, head: EagleHead, slots: int, capacity: int):
        config = head.config
        parameter = next(head.parameters())
        shape = (slots, capacity, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
        self.values = torch.zeros_like(self.keys)
        self.capacity = capacity
        self.free = list(range(slots - 1, -1, -1))

    def cache(self) -> tuple[int, HeadCache] | None:
        """A free slot and a cache over it; None when every slot is taken."""
        if not self.free:
            return None
        slot = self.free.pop()
        return slot, HeadCache(self.keys[slot], self.values[slot])

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class CapturedSteps:
    """The head's one-token step captured per window bucket. `run(token, hidden, position, slot)` copies
    the inputs in, replays the bucket's graph and returns (hidden (1, h), logits (V,)), valid until the
    next run."""

    def __init__(self, head: EagleHead, pool: HeadPool, smallest_window: int = 128):
        self.head, self.pool = head, pool
        parameter = next(head.parameters())
        device = parameter.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(1, head.config.hidden_size, dtype=parameter.dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.windows = window_sizes(pool.capacity, smallest_window)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool_handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def _window(self, size: int):
        pool, slot, position = self.pool, self.slot, self.position

        def attend(k, v):  # (1, kv, D) each: written at (slot, position); the slot's first `size` read
            pool.keys.index_put_((slot, position), k)
            pool.values.index_put_((slot, position), v)
            keys = pool.keys.index_select(0, slot)[0, :size]
            values = pool.values.index_select(0, slot)[0, :size]
            visible = (torch.arange(size, device=k.device) <= position)[None]  # (1, size)
            return keys, values, visible
        return attend

    def _step(self, size: int):
        return self.head.step(self.token, self.hidden, self.position, self._window(size))

    def capture(self) -> None:
        """Every bucket's graph (a warm-up on a side stream first: lazy initialization must not be captured).
        The static slot is a scratch write: capturing writes at slot 0, position 0, which the next real
        step of that slot overwrites."""
        device = self.token.device
        for size in self.windows:
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream), torch.inference_mode():
                self._step(size)
            torch.cuda.current_stream(device).wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool_handle, stream=self.stream), torch.inference_mode():
                out = self._step(size)
            self.graphs[size] = (graph, out)

    def run(self, token: torch.Tensor, hidden: torch.Tensor, position: int, slot: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        size = next(size for size in self.windows if size > position)
        graph, (out_hidden, logits) = self.graphs[size]
        self.token.copy_(token.reshape(1))
        self.hidden.copy_(hidden.reshape(1, -1))
        self.position.fill_(position)
        self.slot.fill_(slot)
        graph.replay()
        return out_hidden, logits[-1]
