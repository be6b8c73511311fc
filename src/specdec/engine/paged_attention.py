"""Attention that reads the paged KV pool in place: a Triton kernel over each sequence's block table.

The plain path (`llama_forward`) gathers a sequence's blocks into a window of W contiguous keys and values
per layer (two `index_select`s), builds a (B, groups * T, W) mask and calls SDPA: on a GPU the gathers are
latency-bound launches, a tenth of a decode step with the mask and layout copies (docs/results/
2026-11-27-gpu-kernels.md, -gpu-paged-attention.md). Here one kernel walks the table itself, keys and values loaded where they lie, the mask (a row sees
the keys before `visible`, and where it is a tree's node its ancestors' keys right after them) computed
from the same two integers per row, and no key past the sequence's own end is read (the window bucket's
padding is skipped, not masked). Flash-decoding: at a few rows the sequence's keys are split into
`splits` chunks run side by side (a 1-row step otherwise keeps only kv_heads programs busy), each chunk's
partial softmax written out and combined by a second kernel; with many rows (a prompt) one pass writes
the output directly.

Shapes: B sequences of T rows, N = B x T, heads = kv_heads x groups query heads of D, the pool
(blocks + 1, block_size, kv_heads, D) per layer, the table (B, NB) (W = NB x block_size).
Exactness: a row's result depends on its own query and keys and on the chunk boundaries, which are fixed
by (B, T, W) alone, not by the sequence's length: the same row computed in a 1-row step and in a 5-row
verify of the same bucket sizes sums in the same order. float64 is not served here (SDPA is).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BLOCK_N = 64  # keys per inner step
MAX_BLOCK_M = 64  # query rows per program
BUSY_PROGRAMS = 256  # enough programs to fill an H100's / H200's 132 SMs twice
MAX_SPLITS = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # a head is one tile: padded to a power of two from 16 (tl.dot's least)


def unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None if the kernel can serve this device, dtype and head size, else why not."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the paged attention kernel runs on CUDA devices (or in Triton's interpreter)"
    if dtype not in DTYPES:
        return f"the paged attention kernel serves {[str(d) for d in DTYPES]}, not {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"the paged attention kernel serves head sizes up to {MAX_HEAD_DIM}, not {head_dim}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def splits(programs: int, window: int) -> int:
    """How many chunks each (sequence, KV head, row tile) splits its keys into: a power of two that brings
    the programs near BUSY_PROGRAMS, no more chunks than blocks of BLOCK_N keys in the window."""
    count = 1
    while count < MAX_SPLITS and programs * count * 2 <= BUSY_PROGRAMS and count * 2 * BLOCK_N <= window:
        count *= 2
    return count


def row_tile(rows: int) -> int:
    """Query rows per program: a power of two from 16 (tl.dot's least) up to MAX_BLOCK_M."""
    tile = 16
    while tile < rows and tile < MAX_BLOCK_M:
        tile *= 2
    return tile


@functools.cache
def _kernels():
    """The two Triton kernels, defined on first use (triton imported only where the kernel serves)."""
    import triton
    import triton.language as tl

    # The sizes that change from bucket to bucket are not specialized on (Triton otherwise compiles a variant
    # for each value that is 1 or a multiple of 16): fewer variants to compile while the graphs are captured.
    @triton.jit(do_not_specialize=["T", "M", "tiles", "table_stride"])
    def partial_attention(q_ptr, k_ptr, v_ptr, table_ptr, visible_ptr, ancestors_ptr, limit_ptr,
                          out_ptr, acc_ptr, m_ptr, l_ptr, scale_log2, T, M, tiles, heads, kv_heads, groups,
                          table_stride, block_size, chunk,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          SPLITS: tl.constexpr, IEEE: tl.constexpr):
        bh = tl.program_id(0)
        tile = tl.program_id(1)
        split = tl.program_id(2)
        b = bh // kv_heads
        h = bh % kv_heads
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row r: query head h * groups + r // T, token r % T
        row_ok = rows < M
        token = b * T + rows % T
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q_at = (token * heads + h * groups + rows // T) * D
        q = tl.load(q_ptr + q_at[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        visible = tl.load(visible_ptr + token, mask=row_ok, other=0)
        ancestors = tl.load(ancestors_ptr + token, mask=row_ok, other=0)
        start = split * chunk
        end = tl.minimum(start + chunk, tl.load(limit_ptr + b).to(tl.int32))
        # No row of this tile sees past its own end (a prompt's early rows: half the keys of a long prompt's
        # forward): a chain's row the keys before `visible`, a tree's node also the new rows after them.
        # The chunks stay where they are, so a row sums in the same order whatever tile it is in.
        reach = tl.where(row_ok, visible + tl.where(ancestors != 0, T, 0), 0)
        end = tl.minimum(end, tl.max(reach, 0).to(tl.int32))
        # A finite floor, not -inf: a chunk whose keys a row cannot see then leaves m = floor, l = 0, acc = 0
        # (exp2 of -inf - floor is 0), never NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for first in range(start, end, BLOCK_N):
            keys_at = first + tl.arange(0, BLOCK_N)
            key_ok = keys_at < end
            block = tl.load(table_ptr + b * table_stride + keys_at // block_size, mask=key_ok, other=0)
            kv_at = ((block * block_size + keys_at % block_size) * kv_heads + h) * D
            k = tl.load(k_ptr + kv_at[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale_log2
            # >= 0: the key is one of the new rows, a tree's node where bit `offset` of the row's ancestors is set
            # (64 bits: llama_forward.MAX_TREE_ROWS)
            offset = keys_at[None, :] - visible[:, None]
            bit = (ancestors[:, None] >> tl.minimum(tl.maximum(offset, 0), 63)) & 1
            seen = ((offset < 0) | ((offset < 64) & (bit == 1))) & key_ok[None, :]
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_at[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # a padding row of the tile saw nothing
            tl.store(out_ptr + q_at[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            at = ((bh * tiles + tile) * SPLITS + split) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(m_ptr + at, m_i)
            tl.store(l_ptr + at, l_i)
            tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc)

    @triton.jit(do_not_specialize=["T", "M", "tiles"])
    def combine_attention(acc_ptr, m_ptr, l_ptr, out_ptr, T, M, tiles, heads, kv_heads, groups,
                BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
        pid = tl.program_id(0)  # one (sequence, KV head, row)
        row = pid % M
        bh = pid // M
        b = bh // kv_heads
        h = bh % kv_heads
        at = ((bh * tiles + row // BLOCK_M) * SPLITS + tl.arange(0, SPLITS)) * BLOCK_M + row % BLOCK_M
        m = tl.load(m_ptr + at)
        weight = tl.exp2(m - tl.max(m, 0))
        total = tl.sum(weight * tl.load(l_ptr + at), 0)
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + at[:, None] * BLOCK_D + d[None, :])
        out = tl.sum(acc * weight[:, None], 0) / total
        q_at = ((b * T + row % T) * heads + h * groups + row // T) * D
        tl.store(out_ptr + q_at + d, out.to(out_ptr.dtype.element_ty), mask=d < D)

    return partial_attention, combine_attention


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                    visible: torch.Tensor, ancestors: torch.Tensor, limit: torch.Tensor, scale: float) -> torch.Tensor:
    """q (N, heads, D) contiguous, keys/values one layer's pool (blocks + 1, block_size, kv_heads, D),
    table (B, NB), visible and ancestors (B, T) as `llama_forward.Batch` holds them, limit (B,): how many
    of a sequence's keys any of its rows may see (its end) -> (N, heads, D), each row's attention over
    its keys (`llama_forward.attention_mask`'s), in q's dtype."""
    partial_attention, combine_attention = _kernels()
    b, t = visible.shape
    heads, d = q.shape[1], q.shape[2]
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    rows = groups * t
    tile = row_tile(rows)
    block_d = max(16, 1 << (d - 1).bit_length())
    tiles = -(-rows // tile)
    window = table.shape[1] * block_size
    count = splits(b * kv_heads * tiles, window)
    chunk = -(-window // (count * BLOCK_N)) * BLOCK_N
    out = torch.empty_like(q)
    if count == 1:
        acc = m = l = out  # unused
    else:
        slots = b * kv_heads * tiles * count * tile
        m = torch.empty(2 * slots, dtype=torch.float32, device=q.device)
        m, l = m[:slots], m[slots:]
        acc = torch.empty(slots * block_d, dtype=torch.float32, device=q.device)
    scale_log2 = scale * 1.4426950408889634  # exp(x) = exp2(x log2 e)
    partial_attention[(b * kv_heads, tiles, count)](
        q, keys, values, table, visible, ancestors, limit, out, acc, m, l, scale_log2, t, rows, tiles, heads,
        kv_heads, groups, table.stride(0), block_size, chunk,
        BLOCK_M=tile, BLOCK_N=BLOCK_N, D=d, BLOCK_D=block_d, SPLITS=count, IEEE=q.dtype == torch.float32)
    if count > 1:
        combine_attention[(b * kv_heads * rows,)](acc, m, l, out, t, rows, tiles, heads, kv_heads, groups,
                                       BLOCK_M=tile, D=d, BLOCK_D=block_d, SPLITS=count)
    return out
