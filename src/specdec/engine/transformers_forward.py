"""The eager forward: transformers' own model forward over packed rows, reading and appending to each
sequence's contiguous KV buffers (`kv_cache.ContiguousKV`) through the attention `kv_cache` registers.

Several sequences' new tokens run as one packed row with per-token positions (no padding to a common
width); each sequence's segment attends to its own buffers in place. It serves any architecture
transformers runs with a standard attention interface, on any device, and a model spread over GPUs.
"""

from __future__ import annotations

import torch

from specdec.engine.interfaces import ForwardOutput
from specdec.engine.kv_cache import KVBatch, SequenceKV, tree_depths, use_sequence_kv

EXACT_ROWS = 16  # forwards of up to this many token rows always run at their own size


def padded_rows(rows: int, min_rows: int = 1, bucketed: bool = False) -> int:
    """How many token rows a forward of `rows` runs with (padding rows are dropped afterwards).

    2 .. min_rows - 1 rows are padded to min_rows. With `bucketed`, more than EXACT_ROWS rows are rounded
    up to one of 8 sizes per power of two (at most 12.5 % padding, 17 -> 18, 300 -> 320), so a server sees
    a bounded set of shapes: oneDNN builds and caches a kernel per (rows, weight) shape it meets, and under
    prompts of every length that cache alone grew a stub's memory without bound.
    """
    if 1 < rows < min_rows:
        return min_rows
    if not bucketed or rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


class TransformersForward:
    """Runs `model` (a transformers causal LM) over the new rows of several sequences at once.

    min_forward_rows: a forward over fewer token rows than this (but more than one) is padded up to it:
    with torch's own CPU kernels, GEMMs of 2-3 rows take a slower BLAS path than 4. Padding rows attend
    to nothing and are never cached. row_buckets: bound the shapes oneDNN's kernel cache keeps
    (`padded_rows`). hidden_layers: a forward also returns the residual stream after these layers at every
    new position (what a trained draft head reads). Rows may be trees (`Step.tree`)."""

    max_tree_rows = None  # any tree: its mask is built per sequence

    def __init__(self, model, min_forward_rows: int = 1, row_buckets: bool = False,
                 hidden_layers: tuple[int, ...] = ()):
        layers = model.config.get_text_config().num_hidden_layers
        if any(not 0 <= layer < layers for layer in hidden_layers):
            raise ValueError(f"hidden_layers {list(hidden_layers)} must be within [0, {layers}) (the model's layers)")
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        use_sequence_kv(model)
        # Where inputs go (a spread model: its first layer's), read once: transformers looks it up through
        # the parameters on every access, several times per forward.
        self.device = model.device
        self.min_forward_rows = min_forward_rows
        self.row_buckets = row_buckets

    def warm_up(self, time_budget_s: float = 0.0) -> tuple[int, float]:
        """Nothing is captured eagerly: (0 buckets ready, 0 s)."""
        return 0, 0.0

    def summary(self, ready: int, seconds: float) -> str:
        return "dynamic executor: transformers' forward, per-sequence KV buffers"

    def __call__(self, seqs: list[SequenceKV], rows: list, num_logits: list[int],
                 trees: list[tuple[int, ...] | None] | None = None) -> ForwardOutput:
        """One packed forward over several sequences: seqs[b]'s new tokens rows[b] are written to its cache
        after its seqs[b].length cached ones (the caller then moves the lengths on), and it gets the logits
        (num_logits[b], V) of its last num_logits[b] new positions. A row is a list of ids or a 1-D tensor
        of ids already on the model's device (drafted tokens: no trip through the host); with trees[b], a
        tree whose nodes sit at the positions after their parents'."""
        if all(isinstance(row, list) for row in rows):
            ids = torch.tensor([token for row in rows for token in row], device=self.device)
        else:
            ids = torch.cat([row if isinstance(row, torch.Tensor) else torch.tensor(row, device=self.device)
                             for row in rows])
        trees = trees or [None] * len(seqs)
        positions = [seq.length + depth for seq, row, tree in zip(seqs, rows, trees)
                     for depth in (range(len(row)) if tree is None else tree_depths(tree))]
        heads, end = [], 0  # packed indices of the positions whose logits are wanted
        for row, n in zip(rows, num_logits):
            end += len(row)
            heads += range(end - n, end)
        # Pad the body and the head to padded_rows. Padding tokens follow every segment, attend to nothing
        # and are never cached; padded head rows are dropped.
        pad = padded_rows(len(ids), self.min_forward_rows, self.row_buckets) - len(ids)
        if pad:
            ids, positions = torch.cat([ids, ids.new_zeros(pad)]), positions + [positions[-1]] * pad
        wanted = len(heads)
        size = padded_rows(max(wanted, 1), self.min_forward_rows, self.row_buckets)
        heads += [heads[-1] if heads else 0] * (size - wanted)
        out = self.model(input_ids=ids[None],
                         position_ids=torch.tensor([positions], device=self.device), use_cache=False,
                         logits_to_keep=torch.tensor(heads, device=self.device),
                         output_hidden_states=bool(self.hidden_layers),
                         kv_batch=KVBatch(seqs, [len(row) for row in rows], trees if any(trees) else None))
        split = list(num_logits)
        logits = list(out.logits[0][:wanted].split(split))
        if not self.hidden_layers:
            return ForwardOutput(logits, None)
        # hidden_states[0] is the embeddings' output, [l + 1] layer l's: (1, rows, H) each; every new row's
        # (a head reads the target's features at every position), the padding's dropped
        counts = [len(row) for row in rows]
        hidden = torch.stack([out.hidden_states[layer + 1][0, :sum(counts)] for layer in self.hidden_layers],
                             dim=1)  # (rows, L, H)
        return ForwardOutput(logits, list(hidden.split(counts)))
