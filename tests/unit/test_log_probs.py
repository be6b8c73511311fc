"""return_log_probs in the decode loop: every generated token's log-probability under the target's raw
distribution, checked against one forward of the target over prompt + output (real tiny models, in
process), greedy and sampled, with a draft model and prompt lookup, and cut where generation stops."""

import asyncio

import pytest
import torch
from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams, greedy_log_probs, token_log_probs
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import noisy_copy

PROMPT = [5, 17, 3, 5, 17, 3, 8, 40, 5, 17]


def test_greedy_and_token_log_probs_are_the_log_softmax_entries():
    torch.manual_seed(0)
    logits = torch.randn(6, 50, dtype=torch.float64) * 4
    logits[:, 40:] = float("-inf")  # padded vocabulary
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(greedy_log_probs(logits).double(), reference.max(-1).values, atol=1e-5)
    tokens = torch.tensor([0, 3, 39, 7, 7, 12])
    assert torch.allclose(token_log_probs(logits, tokens).double(), reference[torch.arange(6), tokens], atol=1e-5)
    assert greedy_log_probs(logits.to(torch.bfloat16)).dtype == torch.float32


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's log-probability of each output token, from one forward over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    rows = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)
    return rows[torch.arange(len(output)), torch.tensor(output)]


def _run(req, proposer, scorer, k):
    async def main():
        return [rnd async for rnd in generate(req, proposer, scorer, DraftLengthPolicy.fixed(k))]
    return asyncio.run(main())


@pytest.mark.parametrize("draft,k,temperature", [
    ("none", 0, 0.0), ("draft_model", 3, 0.0), ("ngram", 4, 0.0), ("draft_model", 3, 1.0), ("ngram", 4, 0.8)])
def test_each_token_carries_the_targets_log_probability(tiny_lm, draft, k, temperature):
    target = dynamic_executor(tiny_lm)
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(tiny_lm)))
    req = GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=40, log_probs=True,
                            sampling=SamplingParams(temperature=temperature, seed=11))
    rounds = _run(req, proposer, LocalScorer(target), k)
    output = [token for rnd in rounds for token in rnd.new_tokens]
    log_probs = [value for rnd in rounds for value in rnd.log_probs]
    assert all(len(rnd.log_probs) == len(rnd.new_tokens) for rnd in rounds)
    assert len(output) == 40
    if k:  # rounds that took several tokens, and rounds that rejected
        assert sum(rnd.num_accepted for rnd in rounds) > 0 and any(rnd.num_accepted < k for rnd in rounds[:-1])
    # Raw log-probabilities: temperature and filters change which tokens are drawn, not what is reported.
    assert torch.allclose(torch.tensor(log_probs, dtype=torch.float64), _reference(tiny_lm, PROMPT, output),
                          atol=1e-4)
    plain = _run(GenerationRequest(seq_id=4, prompt_ids=PROMPT, max_tokens=40,
                                   sampling=SamplingParams(temperature=temperature, seed=11)),
                 NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(tiny_lm))),
                 LocalScorer(dynamic_executor(tiny_lm)), k)
    assert all(rnd.log_probs is None for rnd in plain)  # not asked: nothing computed
    assert [token for rnd in plain for token in rnd.new_tokens] == output  # asking changes no token


def test_log_probs_are_cut_with_the_tokens_at_an_end_token(tiny_lm):
    target = dynamic_executor(tiny_lm)
    free = _run(GenerationRequest(seq_id=5, prompt_ids=PROMPT, max_tokens=30, log_probs=True),
                LocalProposer(dynamic_executor(noisy_copy(tiny_lm))), LocalScorer(target), 4)
    output = [token for rnd in free for token in rnd.new_tokens]
    end = output[12]  # generation stops at its first occurrence, which is dropped
    stopped = _run(GenerationRequest(seq_id=6, prompt_ids=PROMPT, max_tokens=30, log_probs=True,
                                     end_ids=frozenset([end])),
                   LocalProposer(dynamic_executor(noisy_copy(tiny_lm))), LocalScorer(dynamic_executor(tiny_lm)), 4)
    kept = [token for rnd in stopped for token in rnd.new_tokens]
    assert kept == output[:output.index(end)] and stopped[-1].finish_reason == "stop"
    assert [len(rnd.log_probs) for rnd in stopped] == [len(rnd.new_tokens) for rnd in stopped]
    assert [v for rnd in stopped for v in rnd.log_probs] == [v for rnd in free for v in rnd.log_probs][:len(kept)]
