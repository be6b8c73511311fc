"""logit_bias and allowed_token_ids (vLLM's keys): the logits against the definition, and the decode loop with
real tiny models (greedy speculative output equals greedy target-only decoding under them; sampled output
follows the biased target's exact distribution)."""

import itertools
import math
import random

import pytest
import torch
from specdec.decoding.interfaces import Proposal
from specdec.decoding.logit_bias import TokenBias, apply_bias
from specdec.decoding.loop import GenerationRequest
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import greedy_plain_and_edited, noisy_copy, run_fixed_k_many, tiny_llama

PROMPT = [5, 17, 3, 5, 17, 3, 8, 40, 5, 17]


def _naive(row, token_bias):
    """One position by the definition: the tokens outside `allowed` at -inf, each bias added."""
    out = row.float().clone()
    for token in range(len(out)):
        if token_bias.allowed is not None and token not in token_bias.allowed:
            out[token] = float("-inf")
    for token, bias in token_bias.bias:
        if token < len(out):
            out[token] += bias
    return out


def test_bias_and_allowed_tokens_are_the_definition_on_random_cases():
    rng = random.Random(0)
    for _ in range(200):
        width = rng.choice([4, 9])
        ids = rng.sample(range(width + 3), rng.randrange(0, 4))  # ids >= width: ignored
        token_bias = TokenBias(tuple((t, rng.uniform(-100, 100)) for t in ids),
                               rng.choice([None, frozenset(rng.sample(range(width + 2), 3))]))
        logits = torch.randn(rng.randrange(1, 5), width, dtype=torch.bfloat16)
        out = apply_bias(logits, token_bias)
        assert out.dtype == torch.float32
        for j in range(len(logits)):
            torch.testing.assert_close(out[j], _naive(logits[j], token_bias), rtol=0, atol=0)
    assert not TokenBias().active and TokenBias(allowed=frozenset([1])).active


def _reference_greedy(model, prompt, n, token_bias):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(_naive(model(torch.tensor([tokens])).logits[0, -1], token_bias).argmax()))
    return tokens[len(prompt):]


BIAS = TokenBias(((5, 4.0), (17, -100.0), (40, 3.0)), frozenset(range(0, 97, 2)) | {5, 17})


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_under_a_bias_is_greedy_target_decoding_under_it(tiny_lm, draft, k):
    plain, output = greedy_plain_and_edited(tiny_lm, PROMPT, draft, k, 24, token_bias=BIAS)
    assert output != plain and 17 not in output and set(output) <= BIAS.allowed
    assert output == _reference_greedy(tiny_lm, PROMPT, 24, BIAS)


class FixedProposer:
    """Always proposes token 6 (a deterministic draft): the biased target accepts it often, so the second
    token comes from the verify's second position in many runs."""

    async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
        return Proposal([6] * k, None, keep + len(new_ids) + k - 1)

    async def release(self, seq_id):
        pass


@pytest.mark.parametrize("draft", ["draft_model", "fixed"])
def test_sampled_speculation_follows_the_biased_target(draft):
    """Two tokens, the first round drafting one, from an 8-token tiny llama, 3000 seeded runs, against the
    exact joint distribution of sampling the biased, restricted target token by token."""
    model = tiny_llama(8, seed=3, initializer_range=0.3, max_positions=64)
    prompt = [1, 2, 3, 1]
    token_bias = TokenBias(((2, 3.0), (4, -3.0), (6, 2.5)), frozenset([0, 2, 4, 6, 7]))
    exact = {}
    with torch.no_grad():
        first = torch.softmax(_naive(model(torch.tensor([prompt])).logits[0, -1], token_bias), -1)
        for a in range(8):
            second = torch.softmax(_naive(model(torch.tensor([prompt + [a]])).logits[0, -1], token_bias), -1)
            for b in range(8):
                exact[(a, b)] = float(first[a] * second[b])
    target = dynamic_executor(model)
    proposer = LocalProposer(dynamic_executor(noisy_copy(model))) if draft == "draft_model" else FixedProposer()
    n = 3000
    seen = {}
    requests = [GenerationRequest(seq_id=100 + seed, prompt_ids=prompt, max_tokens=2, token_bias=token_bias,
                                  sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
    for out in run_fixed_k_many(requests, proposer, LocalScorer(target), 2):
        seen[tuple(out)] = seen.get(tuple(out), 0) + 1
    assert set(seen) <= {pair for pair, p in exact.items() if p > 0}
    tv = 0.5 * sum(abs(seen.get(key, 0) / n - p) for key, p in exact.items())
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values())
    bound = 2 * noise + 0.01
    assert tv < bound, (tv, bound)
    # The bias matters: the unbiased target's pairs are far outside that bound.
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        plain = {(a, b): float(first[a] * torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].float(), -1)[b])
                 for a, b in itertools.product(range(8), repeat=2)}
    assert 0.5 * sum(abs(plain[key] - exact[key]) for key in exact) > 3 * bound
