"""The paged attention kernel (engine/paged_attention.py) against the gathered window and SDPA it replaces:
alone on random pools (chains, trees, padded rows, split and unsplit key ranges), and inside the static
executor (every bucket with rollbacks, trees of several sequences). On CPU the kernel runs in Triton's
interpreter (TRITON_INTERPRET=1); tests/gpu runs it compiled, in CUDA graphs."""

import os

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from specdec.engine import paged_attention
from specdec.engine.build import static_executor
from specdec.engine.executor import Step
from specdec.engine.llama_forward import Batch, ancestor_bits, attention_mask

triton = pytest.importorskip("triton", reason="the kernel's tests need Triton (its interpreter on CPU)")


if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it where no GPU is
    pytest.skip("the kernel runs compiled on a GPU: tests/gpu", allow_module_level=True)


def gathered(q, keys, values, table, visible, ancestors, scale):
    """What llama_forward's sdpa path computes: the window gathered, masked, SDPA over grouped heads."""
    b, t = visible.shape
    n, heads, d = q.shape
    kv_heads = keys.shape[2]
    groups = heads // kv_heads
    window = table.shape[1] * keys.shape[1]
    mask = attention_mask(Batch(None, None, None, None, table, visible, ancestors, None), window)
    mask = mask[:, None, None].expand(b, 1, groups, t, window).reshape(b, 1, groups * t, window)
    seen_k = keys[table].view(b, window, kv_heads, d).transpose(1, 2)
    seen_v = values[table].view(b, window, kv_heads, d).transpose(1, 2)
    q = q.view(b, t, heads, d).transpose(1, 2).reshape(b, kv_heads, groups * t, d)
    out = scaled_dot_product_attention(q, seen_k, seen_v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, t, d).transpose(1, 2).reshape(n, heads, d)


# (sequences, rows, query heads, KV heads, head size, block size, blocks per table): split key ranges
# (few programs), one pass (many row tiles), a row tile of 64 spanning groups, a window of one block, head
# sizes that are padded (8, 24), a prompt's forward whose first row tiles end early (150 rows of one group).
SHAPES = [(2, 1, 8, 2, 16, 16, 8), (3, 5, 4, 4, 32, 32, 4), (1, 40, 6, 2, 16, 16, 16), (4, 3, 4, 1, 16, 64, 1),
          (2, 4, 4, 2, 8, 8, 6), (1, 2, 2, 1, 24, 16, 5), (1, 150, 2, 2, 16, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_matches_the_gathered_window(shape, dtype):
    b, t, heads, kv_heads, d, block_size, nb = shape
    gen = torch.Generator().manual_seed(sum(shape))
    blocks = 40
    keys, values = (torch.randn(blocks + 1, block_size, kv_heads, d, generator=gen).to(dtype) for _ in range(2))
    table = torch.stack([torch.randperm(blocks, generator=gen)[:nb] for _ in range(b)])
    window = nb * block_size
    lengths = torch.randint(0, window - t + 1, (b,), generator=gen)
    visible = lengths[:, None] + torch.arange(1, t + 1)  # a chain: row j sees the cache and rows <= j
    ancestors = torch.zeros(b, t, dtype=torch.long)
    if 3 <= t <= 64:  # sequence 0 verifies a tree instead: its rows see the cache and their ancestors
        tree = tuple([-1, 0, -1] + [j - 2 for j in range(3, t)])
        visible[0] = lengths[0]
        ancestors[0] = torch.tensor(ancestor_bits(tree))
    if b > 2:  # a padding sequence, as Batch.clear leaves it: the scratch block, one key seen
        table[-1], visible[-1], ancestors[-1] = blocks, 1, 0
    limit = (visible.amax(1) + t).clamp(max=window)
    q = torch.randn(b * t, heads, d, generator=gen).to(dtype)
    scale = d ** -0.5
    got = paged_attention.paged_attention(q, keys, values, table, visible, ancestors, limit, scale)
    want = gathered(q.float(), keys.float(), values.float(), table, visible, ancestors, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want, atol=tolerance), (got.float() - want).abs().max()


def test_keys_past_a_sequences_end_are_never_read():
    """The window's padding may hold anything (a reused block's NaNs included): nothing past `limit` counts."""
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(9, 16, 1, 16, generator=gen) for _ in range(2))
    table = torch.tensor([[0, 1, 2, 3]])
    visible, ancestors = torch.tensor([[20]]), torch.zeros(1, 1, dtype=torch.long)
    q = torch.randn(1, 2, 16, generator=gen)
    clean = paged_attention.paged_attention(q, keys, values, table, visible, ancestors, torch.tensor([21]), 0.25)
    keys[2:4], values[2:4] = float("nan"), float("nan")  # keys 32..63: past the end
    dirty = paged_attention.paged_attention(q, keys, values, table, visible, ancestors, torch.tensor([21]), 0.25)
    assert torch.equal(clean, dirty) and not clean.isnan().any()


def test_splits_fill_the_device_and_tiles_cover_the_rows():
    assert paged_attention.splits(8, 512) == 8  # a 1-row step of 8 KV heads: 8 chunks of 64 keys
    assert paged_attention.splits(8, 4096) == 16  # at most MAX_SPLITS
    assert paged_attention.splits(256, 4096) == 1  # a prompt's many row tiles fill the device alone
    assert paged_attention.splits(8, 64) == 1  # a window of one chunk
    assert [paged_attention.row_tile(rows) for rows in (1, 16, 17, 68, 500)] == [16, 16, 32, 64, 64]


def test_the_choice_of_attention(tiny_lm, tiny_lm32):
    options = dict(kv_pool_tokens=256, block_size=8, max_context=64, max_batch=2, max_rows=3, min_window=16,
                   compile="off", prefix_caching=False)
    # on the CPU, paged is csrc/cpu_layer.cpp's kernel (float32), never Triton's interpreter
    assert static_executor(tiny_lm32, **options).forward.llama.attention == "paged"
    assert static_executor(tiny_lm32, **options).forward.llama.cpu_attention
    assert static_executor(tiny_lm, **options).forward.llama.attention == "sdpa"
    assert static_executor(tiny_lm32, attention="paged", **options).forward.llama.attention == "paged"
    with pytest.raises(ValueError, match="attention must be one of"):
        static_executor(tiny_lm32, attention="flash", **options)
    with pytest.raises(ValueError, match="attention=paged: .*float64"):
        static_executor(tiny_lm, attention="paged", **options)


def test_paged_refused_off_cuda_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # read on each call
    assert "CUDA" in paged_attention.unavailable(torch.device("cpu"), torch.float32, 64)
    assert "up to 256" in paged_attention.unavailable(torch.device("cuda"), torch.float16, 320)


@pytest.fixture(scope="module")
def tiny_lm32():
    from tests.unit.conftest import tiny_llama

    return tiny_llama(97, seed=0, initializer_range=0.5, max_positions=256).to(torch.float32)


def test_the_static_executor_gives_the_same_logits_in_every_bucket(tiny_lm32):
    from tests.unit.test_static_executor import run_every_bucket, static

    sdpa = static(tiny_lm32, attention="sdpa")
    run_every_bucket(sdpa, static(tiny_lm32, attention="paged"), atol=1e-4)  # float32 rounding


def test_trees_of_several_sequences_match(tiny_lm32):
    from tests.unit.test_forward_extensions import BATCH, _executor

    outs = []
    for attention in ("sdpa", "paged"):
        lm = _executor(tiny_lm32, "static", attention=attention)
        lm.extend_many([Step(seq, 0, prompt, 1) for seq, prompt, _, _ in BATCH])
        outs.append(lm.extend_many([Step(seq, len(prompt), ids, num_logits=len(ids), tree=tree)
                                    for seq, prompt, ids, tree in BATCH]))
        assert lm.forward.llama.attention == attention
    for want, got in zip(*outs):
        assert torch.allclose(want, got, atol=1e-4), (want - got).abs().max()
