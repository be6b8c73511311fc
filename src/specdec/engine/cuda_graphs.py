"""What replaying forwards as CUDA graphs needs: inputs staged in pinned host memory and sent in one
copy, and one bucket's forward captured as a graph."""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from specdec.engine.llama_forward import Batch


class InputStaging:
    """Where a forward's integer inputs are assembled on the host before their one copy to the device.

    On CUDA the host buffers are pinned and used in turn: a copy from pinned memory is asynchronous, so
    the host prepares the next draft step while the GPU still runs this one (from pageable memory the
    copy waits for the stream first: a host sync per drafted token). A buffer is refilled only once its
    last copy has completed (an event per buffer). On CPU there is nothing to copy."""

    SLOTS = 4

    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers = [self._buffer(capacity) for _ in range(self.SLOTS if self.pinned else 1)]
        self.events: list = [None] * len(self.buffers)
        self.slot = 0

    def _buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.long, pin_memory=self.pinned)

    def host(self, size: int) -> np.ndarray:
        """A host buffer of `size` int64 values to fill (until the next `host` call)."""
        self.slot = (self.slot + 1) % len(self.buffers)
        if self.events[self.slot] is not None:
            self.events[self.slot].synchronize()
        if self.buffers[self.slot].numel() < size:
            self.buffers[self.slot] = self._buffer(max(size, 2 * self.buffers[self.slot].numel()))
        return self.buffers[self.slot].cpu().numpy()[:size]  # a host tensor: .cpu() is itself

    def send(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The last filled buffer on the device: copied into `out` (or a new tensor) on CUDA, the buffer
        itself on CPU (copied into `out` where one is given)."""
        source = self.buffers[self.slot][:size]
        if not self.pinned:
            return source if out is None else out[:size].copy_(source)
        out = torch.empty(size, dtype=torch.long, device=self.device) if out is None else out[:size]
        out.copy_(source, non_blocking=True)
        self.events[self.slot] = torch.cuda.Event()
        self.events[self.slot].record()
        return out


class CapturedForward:
    """One bucket's forward as a CUDA graph: static input tensors, the graph and its output. `run` copies
    a batch in, replays, and returns the output (valid until the next run)."""

    def __init__(self, forward: Callable[..., torch.Tensor], shape: tuple[int, int, int], scratch: int,
                 device: torch.device, graph_pool, stream: torch.cuda.Stream, head_rows: int = 0):
        b, t, blocks = shape
        # The static inputs, and room after them for the indices of the rows wanted (at most b * t). With
        # head_rows (a prompt's bucket) the head runs on the first head_rows of those indices only: the
        # output is (head_rows, V), not one row of logits per token.
        size = Batch.size(b, t, blocks)
        self.flat = torch.zeros(size + b * t, dtype=torch.long, device=device)
        self.inputs = Batch.view(self.flat, b, t, blocks)
        self.inputs.clear(scratch)  # the pool's scratch block
        if head_rows:
            head = self.flat[size:size + head_rows]
            forward = functools.partial(forward, head_rows=head)
        # Warm up on a side stream (lazy initialization must not be captured), then capture. The static
        # inputs point every write at the scratch block: capturing touches no sequence. One side stream
        # for every bucket: the allocator caches freed memory per stream (and cuBLAS a workspace per
        # stream), so a stream per bucket would keep one forward's worth of memory per bucket.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward(self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=graph_pool):
            self.output = forward(self.inputs)

    def run(self) -> torch.Tensor:
        """Replay over what `flat` holds now; the output is valid until the next run."""
        self.graph.replay()
        return self.output
