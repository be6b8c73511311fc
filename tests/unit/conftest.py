import asyncio
import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.engine.onednn_linear import TIMES_DIR_ENV


@pytest.fixture(autouse=True)
def kernel_times_of_its_own(tmp_path_factory, monkeypatch):
    """Each test keeps its linear-kernel timings apart: one that plants times must not find another's."""
    monkeypatch.setenv(TIMES_DIR_ENV, str(tmp_path_factory.mktemp("kernel-times")))


@pytest.fixture
def server_ports_free(monkeypatch):
    """Free ports for the launcher's server, OpenAI API and readiness endpoint: it refuses to start on ports
    something listens on (a developer's `make serve`, say), and tests that run its main with the default ones
    would stop there."""
    from specdec.serving.server import free_ports

    for name, port in zip(("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "HEALTH_PORT"), free_ports(5)):
        monkeypatch.setenv(name, str(port))


def tiny_llama(vocab_size: int, seed: int, initializer_range: float, max_positions: int):
    """A tiny llama built from a config with a fixed seed (no download), float64 for exact comparisons."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         initializer_range=initializer_range)
    return LlamaForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="session")
def tiny_lm():
    return tiny_llama(97, seed=0, initializer_range=0.5, max_positions=256)


@pytest.fixture(scope="module")
def fp32_llama():
    """A tiny float32 llama with biases (what the CPU linear kernels run; the biases exercise their bias
    path), one per test module: tests swap its layers and dtype."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_bias=True)
    return LlamaForCausalLM(config).eval()


def run_fixed_k(req, proposer, scorer, k, stats=None):
    """The tokens the decode loop generates for req with a fixed draft length k (its Stats into `stats`)."""
    return run_fixed_k_many([req], proposer, scorer, k, stats=stats)[0]


def run_fixed_k_many(requests, proposer, scorer, k, width: int = 128, branches: int = 1, stats=None):
    """run_fixed_k for many requests, `width` at a time in one event loop: the Local proposer and scorer
    run the calls of one turn as one batch (one forward for all), so a sampled-distribution test's
    thousands of short generations take a few hundred forwards. Outputs in the requests' order."""
    from specdec.decoding.draft_length import DraftLengthPolicy
    from specdec.decoding.loop import generate

    async def main():
        gate = asyncio.Semaphore(width)

        async def one(req):
            async with gate:
                return [t async for rnd in generate(req, proposer, scorer, DraftLengthPolicy.fixed(k, branches=branches),
                                                    stats) for t in rnd.new_tokens]
        return await asyncio.gather(*(one(req) for req in requests))
    return asyncio.run(main())


def greedy_plain_and_edited(lm, prompt, draft, k, n, **edits):
    """Greedy outputs of the loop on `lm`: target-only without the request's logit edits, and with them
    (`edits`: GenerationRequest fields), drafted by `draft` ("none", "draft_model": a noisy copy, or "ngram")
    with a fixed K."""
    from specdec.decoding.loop import GenerationRequest
    from specdec.decoding.ngram_proposer import NgramProposer
    from specdec.engine.build import dynamic_executor
    from specdec.engine.local import LocalProposer, LocalScorer

    plain = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=n), NgramProposer(),
                        LocalScorer(dynamic_executor(lm)), 0)
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(lm)))
    edited = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=n, **edits), proposer,
                         LocalScorer(dynamic_executor(lm)), k)
    return plain, edited


class FakeTensor:
    """A pb_utils.Tensor's read side: name() and as_numpy()."""

    def __init__(self, name, value):
        self._name, self._value = name, np.asarray(value)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value

    def is_cpu(self):
        return True


def noisy_copy(target):
    """The target with noise on its head: a draft that agrees with the target often, not always (rejections)."""
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * draft.lm_head.weight.std() * 0.7)
    return draft
