"""Lossless sampling end to end, through the real server: the first two generated tokens of many seeded
requests follow the target's exact joint distribution, with speculation (a draft model, prompt lookup) as
without it, at temperature 1.0 with top-k, at 0.7 with top-p and at 1.0 with min-p.

The exact distribution comes from the same tiny target in process (float64, the same `logits_to_probs`):
p(t1, t2) = p(t1 | prompt) · p(t2 | prompt, t1), mapped to the text the server returns (an end-of-sequence
token ends the text). Outcomes are compared by a chi-square goodness-of-fit test at significance 1e-3,
cells expecting fewer than 5 counts pooled with the mass outside the enumerated support. The tiny pair's
wide initialization makes these distributions peaked, which is what gives the test its power: a draft
distribution misprocessed on its way to the orchestrator shifts mass by far more than the noise.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.decoding.text import decode
from specdec.serving import pairs

from .helpers import grpc_stream

pytestmark = pytest.mark.integration

REQUESTS = 300
# Repeats, so prompt lookup proposes from the first round on.
PROMPT = "the cat sat on the mat and the cat sat on the"
# Filters keep the joint support small enough for 300 requests to test (at T=1.0 unfiltered, the tiny
# target spreads two tokens over millions of outcomes).
SETTINGS = {"T=1.0, top_k=8": SamplingParams(temperature=1.0, top_k=8),
            "T=0.7, top_p=0.8": SamplingParams(temperature=0.7, top_p=0.8),
            "T=1.0, min_p=0.1": SamplingParams(temperature=1.0, min_p=0.1)}
METHODS = {"target-only": dict(num_draft_tokens=0), "draft model K=3": dict(num_draft_tokens=3),
           "prompt lookup K=3": dict(num_draft_tokens=3, draft_model=tn.NGRAM)}
# Target-only sampling is the control: once is enough to show the served filters are the exact ones
CONTROLLED = "T=1.0, top_k=8"


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = pairs.tiny_pair()
    model = AutoModelForCausalLM.from_pretrained(pair.target_path, dtype=torch.float64).eval()
    return model, AutoTokenizer.from_pretrained(pair.tokenizer_path)


def exact_text_distribution(model, tokenizer, params: SamplingParams, coverage: float = 0.999,
                            max_first: int = 2048) -> dict[str, float]:
    """Probability of each text two sampled tokens decode to, over the support covering `coverage` of the
    mass at each step (at most `max_first` first tokens; the rest is left out, to be pooled by the test)."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    eos = tokenizer.eos_token_id

    def top(probs):
        values, order = probs.sort(descending=True)
        keep = int((values.cumsum(0) < coverage).sum()) + 1
        return [(int(t), float(p)) for t, p in zip(order[:keep], values[:keep]) if p > 0]

    with torch.inference_mode():
        first = top(logits_to_probs(model(torch.tensor([ids])).logits[0, -1], params))[:max_first]
        cont = [t for t, _ in first if t != eos]
        second = torch.cat([logits_to_probs(model(torch.tensor([ids + [t] for t in cont[i:i + 256]]),
                                                  logits_to_keep=1).logits[:, -1], params)
                            for i in range(0, len(cont), 256)])
    out: Counter = Counter()
    for t1, p1 in first:
        if t1 == eos:
            out[""] += p1
            continue
        for t2, p2 in top(second[cont.index(t1)]):
            out[decode(tokenizer, [t1] if t2 == eos else [t1, t2])] += p1 * p2
    return dict(out)


def chi_square(observed: Counter, expected_probs: dict[str, float], n: int) -> tuple[float, float]:
    """(statistic, critical value at significance 1e-3) with cells expecting < 5 pooled with the rest."""
    cells, pooled_expected, pooled_observed = [], 1.0, n
    for text, p in expected_probs.items():
        if p * n >= 5:
            cells.append((observed.get(text, 0), p * n))
            pooled_expected -= p
            pooled_observed -= observed.get(text, 0)
    cells.append((pooled_observed, max(pooled_expected, 0.0) * n))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    statistic += sum(1e9 for o, e in cells if e <= 0 and o > 0)  # counts where no mass is expected
    dof = len(cells) - 1
    z = 3.09  # Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-3
    return statistic, dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_first_two_tokens_follow_the_targets_joint_distribution(server, target, setting):
    params = SETTINGS[setting]
    expected = exact_text_distribution(*target, params)
    assert len([p for p in expected.values() if p * REQUESTS >= 5]) >= 3  # enough cells to test anything
    sampling = dict(temperature=params.temperature, top_k=params.top_k or None,
                    top_p=params.top_p if params.top_p < 1 else None,
                    min_p=np.array([[params.min_p]], dtype=np.float32) if params.min_p else None)
    for method, extra in METHODS.items():
        if method == "target-only" and setting != CONTROLLED:
            continue

        def one(seed):
            return grpc_stream(server.grpc_url, PROMPT, max_tokens=2, seed=seed, **sampling, **extra)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(REQUESTS)))
        observed = Counter(r[tn.TEXT_OUTPUT] for r in results)
        if method != "target-only":
            assert sum(r[tn.TOTAL_DRAFT_TOKENS] for r in results) > 0, method  # speculation really ran
        statistic, critical = chi_square(observed, expected, REQUESTS)
        assert statistic < critical, (method, statistic, critical, observed.most_common(8))
