"""The CPU layer kernels (csrc/cpu_layer.cpp, `kernels.cpu()`) against the eager functions and the masked
attention they replace, and the static executor on them against the dynamic one: trees, rollbacks,
several sequences, and a verify's rows equal to the same rows one step at a time, bit for bit."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.engine import kernels, panel_linear
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import Step
from specdec.engine.llama_forward import CPU_KERNEL_ROWS, ancestor_bits, attention_mask, Batch

CPU = kernels.cpu(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(CPU is None, reason=f"the CPU kernels did not build: {panel_linear.build().problem}")


def test_only_float32_on_the_cpu():
    assert kernels.cpu(torch.device("cpu"), torch.float64) is None
    assert kernels.cpu(torch.device("cuda"), torch.float32) is None


def test_each_kernel_matches_the_eager_one_and_a_row_is_the_same_alone():
    gen = torch.Generator().manual_seed(0)
    n, h, heads, kv_heads, d = 5, 72, 4, 2, 16
    x, update = torch.randn(n, h, generator=gen), torch.randn(n, h, generator=gen)
    weight = torch.randn(h, generator=gen)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.randn(n, d // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    gate_up = torch.randn(n, 2 * h, generator=gen)
    pairs = [
        (CPU.rms_norm(x, weight, 1e-5), kernels.EAGER.rms_norm(x, weight, 1e-5)),
        (torch.cat(CPU.add_rms_norm(x, update, weight, 1e-5)),
         torch.cat(kernels.EAGER.add_rms_norm(x, update, weight, 1e-5))),
        (torch.cat([t.flatten(1) for t in CPU.rotate_qk(qkv, cos, sin, heads, kv_heads)], 1),
         torch.cat([t.flatten(1) for t in kernels.EAGER.rotate_qk(qkv, cos, sin, heads, kv_heads)], 1)),
        (CPU.silu_mul(gate_up), kernels.EAGER.silu_mul(gate_up)),
    ]
    for got, want in pairs:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    for r in range(n):  # row r alone: the same bits
        assert torch.equal(CPU.rms_norm(x[r:r + 1], weight, 1e-5), CPU.rms_norm(x, weight, 1e-5)[r:r + 1])
        alone = CPU.rotate_qk(qkv[r:r + 1], cos[r:r + 1], sin[r:r + 1], heads, kv_heads)
        assert all(torch.equal(a, b[r:r + 1]) for a, b in zip(alone, CPU.rotate_qk(qkv, cos, sin, heads, kv_heads)))


def reference_attention(q, keys, values, table, visible, ancestors, scale):
    """The static forward's SDPA path: each sequence's window gathered, masked (`attention_mask`)."""
    b, t = visible.shape
    heads, d = q.shape[1], q.shape[2]
    kv_heads = keys.shape[2]
    window = table.shape[1] * keys.shape[1]
    batch = Batch(None, None, None, None, table, visible, ancestors, None)
    mask = attention_mask(batch, window)[:, None]  # (B, 1, T, W)
    seen_k = keys[table].reshape(b, window, kv_heads, d).repeat_interleave(heads // kv_heads, 2).transpose(1, 2)
    seen_v = values[table].reshape(b, window, kv_heads, d).repeat_interleave(heads // kv_heads, 2).transpose(1, 2)
    out = scaled_dot_product_attention(q.view(b, t, heads, d).transpose(1, 2), seen_k, seen_v, attn_mask=mask,
                                       scale=scale)
    return out.transpose(1, 2).reshape(b * t, heads * d)


# (sequences, rows, query heads, KV heads, head size, block size, blocks per table)
SHAPES = [(2, 1, 8, 2, 16, 16, 8), (3, 5, 4, 4, 32, 32, 4), (1, 40, 6, 2, 16, 16, 16), (4, 3, 4, 1, 20, 64, 1),
          (2, 9, 9, 3, 64, 32, 3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_attention_matches_the_masked_window(shape):
    b, t, heads, kv_heads, d, block_size, nb = shape
    gen = torch.Generator().manual_seed(sum(shape))
    blocks = 40
    keys, values = (torch.randn(blocks + 1, block_size, kv_heads, d, generator=gen) for _ in range(2))
    table = torch.stack([torch.randperm(blocks, generator=gen)[:nb] for _ in range(b)])
    window = nb * block_size
    lengths = torch.randint(0, window - t + 1, (b,), generator=gen)
    visible = lengths[:, None] + torch.arange(1, t + 1)  # a chain: row j sees the cache and rows <= j
    ancestors = torch.zeros(b, t, dtype=torch.long)
    if 3 <= t <= 64:  # sequence 0 verifies a tree: its rows see the cache and their ancestors
        visible[0] = lengths[0]
        ancestors[0] = torch.tensor(ancestor_bits(tuple([-1, 0, -1] + [j - 2 for j in range(3, t)])))
    if b > 2:  # a padding sequence, as Batch.clear leaves it: the scratch block, one key seen
        table[-1], visible[-1], ancestors[-1] = blocks, 1, 0
    q = torch.randn(b * t, heads, d, generator=gen)
    module = panel_linear.build().module
    got = module.paged_attention(q, keys, values, table, visible, ancestors, d ** -0.5)
    want = reference_attention(q, keys, values, table, visible, ancestors, d ** -0.5)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # A row alone gives the same bits as among its sequence's rows (the rows share each chunk of keys read)
    for r in range(t):
        alone = module.paged_attention(q.view(b, t, heads, d)[:, r].contiguous(), keys, values, table,
                                       visible[:, r:r + 1].contiguous(), ancestors[:, r:r + 1].contiguous(),
                                       d ** -0.5)
        assert torch.equal(alone, got.view(b, t, -1)[:, r]), r
    keys[blocks - 1 if blocks - 1 not in table else blocks], values[0 if 0 not in table else blocks] = float("nan"), 0
    assert not module.paged_attention(q, keys, values, table, visible, ancestors, d ** -0.5).isnan().any()


def test_store_kv_writes_what_index_put_writes_and_refuses_a_place_outside_the_pool():
    gen = torch.Generator().manual_seed(5)
    b, t, heads, kv_heads, d = 2, 3, 4, 2, 16
    qkv = torch.randn(b * t, (heads + 2 * kv_heads) * d, generator=gen)
    k = torch.randn(b * t, kv_heads, d, generator=gen)
    block, offset = torch.tensor([[3, 3, 4], [0, 1, 1]]), torch.tensor([[6, 7, 0], [2, 0, 1]])
    keys, values = torch.zeros(5, 8, kv_heads, d), torch.zeros(5, 8, kv_heads, d)
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[block, offset] = k.view(b, t, kv_heads, d)
    want_values[block, offset] = qkv[:, (heads + kv_heads) * d:].reshape(b, t, kv_heads, d)
    module = panel_linear.build().module
    module.store_kv(keys, values, k, qkv, (heads + kv_heads) * d, block, offset)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    with pytest.raises(RuntimeError, match="outside the pool"):
        module.store_kv(keys, values, k, qkv, (heads + kv_heads) * d, block, offset.fill_(8))


def test_a_table_entry_outside_the_pool_is_refused():
    keys = torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        panel_linear.build().module.paged_attention(torch.zeros(1, 1, 16), keys, keys, torch.tensor([[5]]),
                                                   torch.tensor([[2]]), torch.zeros(1, 1, dtype=torch.long), 0.25)


@pytest.fixture(scope="module")
def packed_llama():
    """A tiny float32 llama whose projections fill whole panels (so they fuse), on the panel kernel."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(model.state_dict())
    panel_linear.pack_linears(model)
    return model, plain


def static(model):
    return static_executor(model, kv_pool_tokens=1024, block_size=8, max_context=256, max_batch=4, max_rows=9,
                           compile="off", prefix_caching=False)


def test_the_static_executor_on_the_cpu_kernels_matches_the_dynamic_one(packed_llama):
    model, plain = packed_llama
    paged, reference = static(model), dynamic_executor(plain)
    llama = paged.forward.llama
    assert CPU_KERNEL_ROWS < 80
    assert llama.kernels is not kernels.EAGER and llama.attention == "paged" and llama.cpu_attention
    assert all(isinstance(f, panel_linear.PanelLinear) for f in llama.qkv + llama.gate_up)  # one product each
    gen = torch.Generator().manual_seed(1)
    lengths = {}
    for seq, size in enumerate([3, 17, 80], 1):  # 80 rows: past CPU_KERNEL_ROWS, SDPA's
        prompt = torch.randint(0, 97, (size,), generator=gen).tolist()
        a, b = reference.extend(seq, 0, prompt, 2), paged.extend(seq, 0, prompt, 2)
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
        lengths[seq] = size
    tree = (-1, 0, 0, 1, 2, 2)
    for rows in range(1, 7):
        steps = []
        for seq in lengths:
            keep = max(1, lengths[seq] - (seq + rows) % 3)  # roll back 0-2 rejected tokens
            new = torch.randint(0, 97, (rows,), generator=gen).tolist()
            shape = tree[:rows] if seq == 2 and rows > 2 else None  # sequence 2 verifies trees
            steps.append(Step(seq, keep, new, num_logits=rows, tree=shape))
            lengths[seq] = keep + rows
        for a, b in zip(reference.extend_many(steps), paged.extend_many(steps)):
            assert torch.allclose(a, b, atol=1e-4), (rows, (a - b).abs().max())
        for step in steps:  # a tree's rows are candidates, not the sequence: the next step drops them
            if step.tree is not None:
                lengths[step.seq_id] = step.keep


def test_a_verify_is_its_steps_one_at_a_time_bit_for_bit(packed_llama):
    model, _ = packed_llama
    paged = static(model)
    prompt = list(range(3, 40))
    paged.extend(1, 0, prompt, 1)
    verify = paged.extend(1, len(prompt), [5, 9, 11, 2, 7], 5)
    steps = [paged.extend(1, len(prompt) + i, [token], 1) for i, token in enumerate([5, 9, 11, 2, 7])]
    assert torch.equal(verify, torch.cat(steps))
