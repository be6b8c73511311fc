"""The layer-skip self-draft served (real tritonserver): a 4-layer tiny target drafting for itself with
layers left out, searched on the fly (`draft_skip`) or fixed (`draft_skip_fixed`), with the confidence
stop on (its default). Greedy output equals target-only output; sampled output follows the target's exact
joint distribution of two tokens (chi-square, as test_sampling_distribution.py); the search reports the
set it uses in the log and as metrics."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.sampling import SamplingParams
from specdec.serving import pairs, repository
from specdec.serving.metrics_text import samples

from .helpers import grpc_stream, retire_server, start_server
from .test_sampling_distribution import PROMPT, chi_square, exact_text_distribution

pytestmark = pytest.mark.integration

LAYERS = 4
REQUESTS = 300
PROMPTS = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog and then", PROMPT]


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("deep") / "target"
    tokenizer = AutoTokenizer.from_pretrained(pairs.tiny_pair().tokenizer_path)
    pairs._build_tiny(out, LAYERS, pairs.TINY_SEED + 7, tokenizer)
    return out


@pytest.fixture(scope="module")
def skip_server(deep_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skip-server")
    pair = pairs.PairSpec(name="skip", target_path=str(deep_target), tokenizer_path=str(deep_target),
                          skip_drafts={"draft_skip": tn.SKIP_SEARCH, "draft_skip_fixed": "2"},
                          default_draft=tn.NGRAM, dtype="float64", max_context_tokens=1024)
    server = start_server(tmp, repository=repository.render(pair, tmp / "repo"))
    yield server
    retire_server(server)


@pytest.mark.parametrize("name", ["draft_skip", "draft_skip_fixed"])
def test_greedy_output_with_a_skip_draft_equals_target_only(skip_server, name):
    for prompt in PROMPTS:
        plain = grpc_stream(skip_server.grpc_url, prompt, max_tokens=48, num_draft_tokens=0)
        drafted = grpc_stream(skip_server.grpc_url, prompt, max_tokens=48, num_draft_tokens=4, draft_model=name,
                              adaptive_draft=False)
        assert drafted[tn.TEXT_OUTPUT] == plain[tn.TEXT_OUTPUT], (name, prompt)
        assert drafted[tn.TOTAL_DRAFT_TOKENS] > 0


def test_the_search_reports_its_set_in_the_log_and_the_metrics(skip_server):
    for prompt in PROMPTS * 2:  # texts long enough to measure sets on (32 tokens and more)
        grpc_stream(skip_server.grpc_url, prompt, max_tokens=64, num_draft_tokens=4, draft_model="draft_skip",
                    adaptive_draft=False)
    deadline = time.monotonic() + 30
    while True:
        text = skip_server.metrics()
        trials = sum(v for labels, v in samples(text, "specdec_draft_skip_trials_total")
                     if labels.get("model") == "draft_skip")
        if trials > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert trials > 0
    skipped = {labels["layer"]: v for labels, v in samples(text, "specdec_draft_layer_skipped")
               if labels.get("model") == "draft_skip"}
    assert set(skipped) == {str(i) for i in range(LAYERS)} and skipped["0"] == skipped[str(LAYERS - 1)] == 0
    assert "draft_skip: layer-skip self-draft, searching the layers to skip" in skip_server.log_path.read_text()


def test_sampled_output_with_the_searched_skip_draft_is_the_targets_distribution(skip_server, deep_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(deep_target, dtype=torch.float64).eval()
    params = SamplingParams(temperature=1.0, top_k=8)
    expected = exact_text_distribution(model, AutoTokenizer.from_pretrained(deep_target), params)
    assert len([p for p in expected.values() if p * REQUESTS >= 5]) >= 3

    def one(seed):
        return grpc_stream(skip_server.grpc_url, PROMPT, max_tokens=2, seed=seed, temperature=1.0, top_k=8,
                           num_draft_tokens=3, draft_model="draft_skip")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    assert sum(r[tn.TOTAL_DRAFT_TOKENS] for r in results) > 0
    statistic, critical = chi_square(Counter(r[tn.TEXT_OUTPUT] for r in results), expected, REQUESTS)
    assert statistic < critical, (statistic, critical)


def test_make_bench_lets_the_search_run_and_reads_the_set_it_settled_on(skip_server):
    """`bench/speculative_bench.py`'s step before its skip-draft rows, against this server."""
    from bench.speculative_bench import search_skip_layers

    skipped = search_skip_layers(skip_server.grpc_url, skip_server.metrics_url, max_tokens=48, trials=2)
    assert skipped and all(0 < layer < LAYERS - 1 for layer in skipped)
