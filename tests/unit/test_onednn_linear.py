"""oneDNN-prepacked linear layers compute what the dense layers do."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.engine import onednn_linear
from specdec.engine.build import dynamic_executor
from specdec.engine.executor import Step

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def fp32_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_bias=True)  # biases exercise the bias path
    return LlamaForCausalLM(config).eval()


def test_prepacked_linear_matches_dense_for_any_row_count():
    torch.manual_seed(1)
    dense = torch.nn.Linear(48, 300)
    packed = onednn_linear.PrepackedLinear(dense)
    with torch.inference_mode():
        for shape in ((1, 48), (3, 48), (2, 9, 48), (1, 257, 48)):
            x = torch.randn(shape)
            assert packed(x).shape == dense(x).shape
            assert torch.allclose(packed(x), dense(x), atol=1e-5), shape


def test_prepacked_model_gives_the_dense_models_logits(fp32_llama):
    packed_model = copy.deepcopy(fp32_llama)
    assert onednn_linear.prepack_linears(packed_model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + head
    assert not any(isinstance(m, torch.nn.Linear) for m in packed_model.modules())
    dense, packed = dynamic_executor(copy.deepcopy(fp32_llama)), dynamic_executor(packed_model)
    for lm in (dense, packed):
        lm.extend(1, 0, [5, 17, 3, 88], 1)
    steps = [Step(1, 4, [10, 11, 12], 3), Step(2, 0, [7, 8, 9, 1, 2], 2)]
    for a, b in zip(dense.extend_many(steps), packed.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-4)


def test_resolve_picks_onednn_only_where_it_runs():
    cpu = torch.device("cpu")
    assert onednn_linear.resolve("auto", cpu, torch.float32)
    assert not onednn_linear.resolve("auto", cpu, torch.float64)  # the tiny test pair: exact float64
    assert not onednn_linear.resolve("auto", torch.device("cuda"), torch.float16)
    assert not onednn_linear.resolve("torch", cpu, torch.float32)
    with pytest.raises(ValueError, match="linear_kernels=onednn needs a CPU model"):
        onednn_linear.resolve("onednn", cpu, torch.float64)
    with pytest.raises(ValueError, match="linear_kernels must be one of"):
        onednn_linear.resolve("mkl", cpu, torch.float32)
