"""Trained draft heads served (real tritonserver, tiny pair): an EAGLE-3 head trained here by the training
command, and random EAGLE-1, EAGLE-3 (three Qwen3 decoder layers, in the speculators library's layout), Medusa
heads and an MLP speculator (tied, its input scaled), each a draft_model of its own over target_model's
features, and the same heads hosted in target_model's process (hosted_*: drafting in the verify call); a tiny MiMo
model served with its own MTP layer as vLLM's command line asks (`--speculative-config '{"method": "mtp"}'`).
Greedy output equals target-only output with every head; the trained head is accepted where a random one is
not (its features arrive right over BLS), hosted as much as called; sampled output follows the target's
distribution. (A head made for another target is refused at load naming both: test_load_errors.py.)"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from pathlib import Path

import pytest
from transformers import AutoConfig

from specdec import tensor_names as tn
from specdec.engine.draft_heads import EAGLE, EAGLE3, MEDUSA, MLP, MTP, random_head, save_head
from specdec.serving import pairs, repository
from specdec.serving import server as serving_server
from specdec.train.data import load_prompts

from .helpers import READY_TIMEOUT_S, grpc_stream, http_generate, retire_server, start_server

pytestmark = pytest.mark.integration

AUX = "0,1,1"  # EAGLE-3's layers on the tiny 2-layer target (its default needs at least 4)
TRAIN_PROMPTS = 40


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    pair = pairs.tiny_pair()
    # The training command on the tiny pair: seconds. The tiny target's text has no structure to generalise
    # from, so the trained head is asked about prompts it trained on (the test is of the plumbing).
    trained = root / "trained"
    command = [sys.executable, "-m", "specdec.train", "--target", pair.target_path, "--out", str(trained),
               "--max-prompts", str(TRAIN_PROMPTS), "--answer-tokens", "48", "--epochs", "20", "--lr", "3e-3",
               "--draft-vocab", "2048", "--aux-layers", AUX, "--steps", "3", "--no-chat-template", "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = AutoConfig.from_pretrained(pair.target_path)
    paths = {"head_trained": trained}
    for kind in (EAGLE, EAGLE3, MEDUSA, MLP, MTP):
        # EAGLE-3's as the speculators library trains one for a Qwen3 target (here of three layers), in its layout
        shape = {EAGLE3: {"num_layers": 3, "layer_type": "qwen3", "attention_bias": True},
                 MLP: {"tie_weights": True, "scale_input": True}}.get(kind, {})
        head = random_head(kind, config, seed=1, aux_layers=(0, 1, 1) if kind == EAGLE3 else (),
                           draft_vocab_size=4096 if kind == EAGLE3 else 0, **shape)
        if kind == MTP:  # an MTP layer reads its target's final norm (a MiMo checkpoint holds both)
            head.target_norm.copy_(_tensor(pair.target_path, "model.norm.weight"))
        layout = "speculators" if kind == EAGLE3 else "eagle"
        paths[f"head_random_{kind}"] = save_head(head, root / kind, layout=layout, verifier=pair.target_path)
    return {name: str(path) for name, path in paths.items()}, json.loads((trained / "training.json").read_text())


def _tensor(model_dir: str | Path, key: str):
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as handle:
        return handle.get_tensor(key)


@pytest.fixture(scope="module")
def head_server(heads, tmp_path_factory):
    paths, _ = heads
    tmp = tmp_path_factory.mktemp("head-server")
    hosted = {f"hosted_{name.removeprefix('head_')}": path for name, path in paths.items()}
    pair = dataclasses.replace(pairs.tiny_pair(), draft_heads=paths, hosted_heads=hosted)
    repo = repository.render(pair, tmp / "repo")
    for name in paths:  # every round drafts its whole K (the confidence stop is tested in process)
        repository.override(repo, f"{name}.draft_stop_below=0")
    repository.override(repo, "target_model.hosted_stop_below=0")
    repository.override(repo, "speculative_decoding.draft_branches=3")  # a request may ask for trees 3 wide
    repository.override(repo, "target_model.kv_block_size=8")  # the training prompts fill blocks (prefix caching)
    # a hosted head's greedy rounds run ahead (run_ahead.py; a GPU's default): every hosted test goes through it
    repository.override(repo, "target_model.run_ahead=on")
    server = start_server(tmp, repository=repo)
    yield server
    retire_server(server)


def test_the_training_command_lowers_the_loss_and_writes_the_published_layout(heads):
    paths, record = heads
    assert record["held_out_loss"] < record["held_out_loss_before"], record
    keys = set(json.loads((Path(paths["head_trained"]) / "config.json").read_text()))
    assert {"draft_vocab_size", "eagle_config"} <= keys


GREEDY_PROMPTS = ("the cat sat on the mat", load_prompts()[0])


@pytest.fixture(scope="module")
def target_only(head_server):
    """Each greedy prompt's target-only text: 32 tokens over gRPC, 16 (for the HTTP check)."""
    return {(prompt, n): grpc_stream(head_server.grpc_url, prompt, max_tokens=n, num_draft_tokens=0)[tn.TEXT_OUTPUT]
            for prompt in GREEDY_PROMPTS for n in (32, 16)}


@pytest.mark.parametrize("name", ["head_trained", "head_random_eagle", "head_random_eagle3", "head_random_medusa",
                                  "head_random_mlp_speculator", "head_random_mtp", "hosted_trained",
                                  "hosted_random_eagle", "hosted_random_medusa", "hosted_random_mlp_speculator",
                                  "hosted_random_mtp"])
def test_greedy_output_with_a_head_equals_target_only(head_server, target_only, name):
    for prompt in GREEDY_PROMPTS:
        drafted = grpc_stream(head_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=3, draft_model=name,
                              adaptive_draft=False)
        assert drafted[tn.TEXT_OUTPUT] == target_only[prompt, 32], name
        assert drafted[tn.TOTAL_DRAFT_TOKENS] >= 3 * (drafted["num_rounds"] - 4), drafted  # it drafted each round
    over_http = http_generate(head_server.http_url, prompt, max_tokens=16, num_draft_tokens=2, draft_model=name)
    assert over_http[tn.TEXT_OUTPUT] == target_only[prompt, 16]


@pytest.mark.parametrize("name", ["ngram+head_trained", "ngram+head_random_eagle3", "ngram+hosted_trained"])
def test_greedy_output_with_prompt_lookup_first_and_a_head_otherwise_equals_target_only(head_server, target_only,
                                                                                         name):
    """Every server offers "ngram+HEAD" (lookup_first.py): rounds where the sequence repeats an earlier
    3-gram draft its continuation, the others the head's proposal, the head catching up on the rounds it
    missed (its features included): the text is target-only's, adaptive or not."""
    repeating = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"
    reference = grpc_stream(head_server.grpc_url, repeating, max_tokens=32, num_draft_tokens=0)[tn.TEXT_OUTPUT]
    for prompt, expected in [*((p, target_only[p, 32]) for p in GREEDY_PROMPTS), (repeating, reference)]:
        for adaptive in (False, True):
            drafted = grpc_stream(head_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=3, draft_model=name,
                                  adaptive_draft=adaptive)
            assert drafted[tn.TEXT_OUTPUT] == expected, (name, prompt, adaptive)
            assert adaptive or drafted[tn.TOTAL_DRAFT_TOKENS] > 0


def test_a_trained_head_is_accepted_where_a_random_one_is_not(head_server):
    accepted = {}
    for name in ("head_trained", "head_random_eagle3"):
        drafted = accepted_total = 0
        for prompt in load_prompts()[:6]:  # prompts the head trained on
            out = grpc_stream(head_server.grpc_url, prompt, max_tokens=40, num_draft_tokens=3, draft_model=name,
                              adaptive_draft=False)
            drafted += out[tn.TOTAL_DRAFT_TOKENS]
            accepted_total += out[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]
        accepted[name] = accepted_total / drafted
    assert accepted["head_trained"] > 0.05 and accepted["head_random_eagle3"] < 0.02, accepted


def test_a_hosted_head_drafts_what_the_same_head_called_drafts(head_server):
    """The trained head hosted in target_model and called as a draft model of its own, on the prompts it
    trained on, greedy, K fixed, chains and 3-wide trees: the same text, drafted and accepted tokens (the
    features the hosted head reads are the ones the called head is sent). With run_ahead on, the hosted rounds
    were drafted and verified ahead of their calls."""
    ahead = lambda: head_server.metric("specdec_model_run_ahead_steps_total", model="target_model",  # noqa: E731
                                       outcome="used")
    before = ahead()
    for prompt in load_prompts()[:4]:
        for branches in (1, 3):
            called, hosted = (grpc_stream(head_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=3,
                                          draft_model=name, adaptive_draft=False, num_draft_branches=branches)
                              for name in ("head_trained", "hosted_trained"))
            assert hosted[tn.TEXT_OUTPUT] == called[tn.TEXT_OUTPUT]
            assert (hosted[tn.TOTAL_DRAFT_TOKENS], hosted[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]) == \
                (called[tn.TOTAL_DRAFT_TOKENS], called[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]), (prompt, branches)
    assert head_server.metric("nv_inference_request_success", model="head_trained") > 0
    assert ahead() - before >= 4 * 2 * 3  # the called head's rounds run none ahead (their drafts come in the call)
    log = head_server.log_path.read_text(errors="replace")  # hosted, they draft with the target's own embedding
    for name in ("hosted_trained", "hosted_random_eagle", "hosted_random_eagle3"):
        assert f"hosted head '{name}' borrows the target's embedding" in log, name
    hosted = {name: head_server.metric(f"specdec_hosted_head_{name}_total", model="target_model", head="hosted_trained")
              for name in ("proposals", "draft_tokens", "seconds", "failures")}
    assert hosted["proposals"] > 0 and hosted["draft_tokens"] > hosted["proposals"], hosted
    assert hosted["seconds"] > 0 and hosted["failures"] == 0, hosted


@pytest.mark.parametrize("name", ["head_trained", "hosted_trained"])
def test_a_heads_request_takes_cached_blocks_with_the_features_kept_for_them(head_server, name):
    """A prompt sent twice with the trained head: the second run takes the blocks the first keyed, with the
    features kept for them (prefix_cache.py), and its text and acceptance are the first run's. (A served
    tiny head hardly reads its early positions: the features' values are checked in process, in
    tests/unit/test_draft_heads.py.)"""
    prompt = GREEDY_PROMPTS[1]  # a training prompt: the head accepts some of its answer
    runs = []
    for _ in range(2):
        before = head_server.metric("specdec_model_prefix_cache_hits_total", model="target_model")
        out = grpc_stream(head_server.grpc_url, prompt, max_tokens=24, num_draft_tokens=3, draft_model=name,
                          adaptive_draft=False)
        runs.append((out, head_server.metric("specdec_model_prefix_cache_hits_total", model="target_model") - before))
    (first, _), (again, found) = runs
    assert found >= 8 and again[tn.TEXT_OUTPUT] == first[tn.TEXT_OUTPUT]
    assert first[tn.TOTAL_ACCEPTED_DRAFT_TOKENS] > 0, first
    assert abs(again[tn.TOTAL_ACCEPTED_DRAFT_TOKENS] - first[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]) <= 1, (first, again)


@pytest.mark.parametrize("name", ["head_trained", "hosted_trained"])
def test_sampled_requests_with_a_head_are_reproducible(head_server, name):
    runs = [grpc_stream(head_server.grpc_url, "the cat sat on the mat", max_tokens=24, num_draft_tokens=3,
                        draft_model=name, temperature=1.0, top_k=16, seed=seed) for seed in (5, 5, 6)]
    assert runs[0][tn.TEXT_OUTPUT] == runs[1][tn.TEXT_OUTPUT] != runs[2][tn.TEXT_OUTPUT]
    assert runs[0][tn.TOTAL_DRAFT_TOKENS] > 0


def exact_three_token_texts(prompt: str, params) -> dict[str, float]:
    """The target's exact distribution of the text three sampled tokens decode to (an end token ends it)."""
    from collections import Counter

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.decoding.sampling import logits_to_probs
    from specdec.decoding.text import decode

    pair = pairs.tiny_pair()
    model = AutoModelForCausalLM.from_pretrained(pair.target_path, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(pair.tokenizer_path)
    ids, eos = tokenizer.encode(prompt, add_special_tokens=True), tokenizer.eos_token_id

    def support(prefixes):
        with torch.inference_mode():
            probs = logits_to_probs(model(torch.tensor([ids + p for p in prefixes])).logits[:, -1], params)
        return [[(int(t), float(probs[i, t])) for t in probs[i].nonzero()[:, 0]] for i in range(len(prefixes))]

    out: Counter = Counter()
    (first,) = support([[]])
    seconds = support([[t1] for t1, _ in first])
    pairs_ = [([t1, t2], p1 * p2) for (t1, p1), row in zip(first, seconds) for t2, p2 in row if t1 != eos and t2 != eos]
    thirds = support([prefix for prefix, _ in pairs_])
    for (t1, p1), row in zip(first, seconds):
        if t1 == eos:
            out[""] += p1
            continue
        for t2, p2 in row:
            if t2 == eos:
                out[decode(tokenizer, [t1])] += p1 * p2
    for (prefix, p12), row in zip(pairs_, thirds):
        for t3, p3 in row:
            out[decode(tokenizer, prefix if t3 == eos else prefix + [t3])] += p12 * p3
    return dict(out)


@pytest.mark.parametrize("name", ["head_random_eagle", "head_random_medusa", "head_random_mlp_speculator",
                                  "head_random_mtp", "head_trained", "ngram+head_trained",
                                  "hosted_trained"])  # trained: EAGLE-3
def test_sampled_output_with_a_head_follows_the_targets_distribution(head_server, name):
    """The first three tokens (a head drafts from the second round on: the second token is its draft's)
    of many seeded requests against the target's exact distribution of their text (chi-square, 1e-3).
    ngram+HEAD: the prompt ends in a repeated 3-gram, so prompt lookup drafts the first round's tokens,
    deterministically, and the head those of rounds where the sampled text left the copy."""
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    from specdec.decoding.sampling import SamplingParams

    from .test_sampling_distribution import chi_square

    prompt, requests = "the cat sat on the mat and the cat sat on the", 300
    params = SamplingParams(temperature=1.0, top_k=4)
    expected = exact_three_token_texts(prompt, params)
    assert len([p for p in expected.values() if p * requests >= 5]) >= 3  # enough cells to test anything

    def one(seed):
        return grpc_stream(head_server.grpc_url, prompt, max_tokens=3, seed=seed, temperature=1.0, top_k=4,
                           num_draft_tokens=2, draft_model=name, adaptive_draft=False)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(requests)))
    assert sum(r[tn.TOTAL_DRAFT_TOKENS] for r in results) >= requests // 2  # the head drafted
    statistic, critical = chi_square(Counter(r[tn.TEXT_OUTPUT] for r in results), expected, requests)
    assert statistic < critical, (name, statistic, critical)


@pytest.fixture(scope="module")
def mimo_server(tmp_path_factory):
    """A tiny MiMo model (Qwen2's weights, its MTP layer in the same checkpoint, MiMo's config.json with its
    remote-code classes named: `write_mimo`) served by the launcher as vLLM's command line for it reads: `--target DIR
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tests.unit.test_mtp_heads import write_mimo

    root = tmp_path_factory.mktemp("mimo")
    path = root / "MiMo-tiny"
    tokenizer = AutoTokenizer.from_pretrained(pairs.smollm2_tokenizer_dir())
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    write_mimo(path, model, random_head(MTP, model.config, seed=4))
    tokenizer.save_pretrained(path)
    server = serving_server.start(
        root / "run", root / "tritonserver.log",
        ["--target", str(path), "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3}),
         "--set", f"{tn.DEFAULT_HEAD_NAME}.draft_stop_below=0"], ready_timeout_s=READY_TIMEOUT_S)
    yield server
    retire_server(server)


def test_a_mimo_model_drafts_with_its_own_mtp_layer_and_gives_target_only_output(mimo_server):
    for prompt in GREEDY_PROMPTS:
        expected = grpc_stream(mimo_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=0)
        drafted = grpc_stream(mimo_server.grpc_url, prompt, max_tokens=32, adaptive_draft=False)  # K 3, the MTP layer
        assert drafted[tn.TEXT_OUTPUT] == expected[tn.TEXT_OUTPUT] and expected[tn.TEXT_OUTPUT]
        assert drafted[tn.TOTAL_DRAFT_TOKENS] >= 3 * (drafted["num_rounds"] - 4), drafted
