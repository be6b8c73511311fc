import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_lm():
    """A tiny llama built from a config with a fixed seed (no download), float64 for exact comparisons."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def noisy_copy(target):
    """The target with noise on its head: a draft that agrees with the target often, not always (rejections)."""
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * draft.lm_head.weight.std() * 0.7)
    return draft
