"""A gpt-oss-shaped pair served through the launcher (transformers' forward under the per-sequence KV cache):
layers of a sliding window and of full attention, attention sinks, experts. Greedy speculation (a draft model
that agrees with the target often, not always; prompt lookup) equals target-only decoding and transformers' own
greedy generate() token for token (its second end token, <|call|>, ends a request as every model's
generation_config.json end tokens do: test_generation_config.py). Tiny random models built here (float32)."""

import pytest
import torch

from client import Client, GenerationParams
from specdec.decoding.text import load_tokenizer
from specdec.serving import pairs
from specdec.serving import server as serving_server

from .helpers import READY_TIMEOUT_S, stop_server

pytestmark = pytest.mark.integration

PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat sat on the", "Hello there, how are"]


def build(directory, tokenizer, seed: int, noise: float = 0.0, end_ids=None):
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024,
                          layer_types=["sliding_attention", "full_attention"], eos_token_id=end_ids,
                          bos_token_id=tokenizer.bos_token_id, initializer_range=0.1)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that matter (they start at 0)
            layer.self_attn.sinks.normal_(0.0, 1.0)
        if noise:
            head = model.lm_head.weight
            head.add_(torch.randn_like(head) * head.std() * noise)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gpt-oss")
    tokenizer = load_tokenizer(pairs.tiny_pair().tokenizer_path)
    target = build(tmp_path / "target", tokenizer, seed=3)
    draft = build(tmp_path / "draft", tokenizer, seed=3, noise=0.5)  # the target, its head perturbed
    del draft
    served = serving_server.start(tmp_path / "run", tmp_path / "server.log",
                                  ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")],
                                  ready_timeout_s=READY_TIMEOUT_S)
    yield served, target, tokenizer
    stop_server(served)


def greedy(client: Client, prompt: str, **params) -> tuple[list[int], object]:
    result = client.generate(prompt, GenerationParams(max_tokens=40, return_log_probs=True, num_top_log_probs=1,
                                                      ignore_eos=True, **params))
    return [top[0] for top in result.top_ids], result


def test_greedy_speculation_equals_target_only_and_transformers_generate(gpt_oss):
    served, target, tokenizer = gpt_oss
    client = Client(served.grpc_url, "grpc")
    target.set_attn_implementation("eager")  # transformers' attention with sinks, as the reference
    accepted = rejected = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            reference = target.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, ids.shape[1]:]
        alone, _ = greedy(client, prompt, num_draft_tokens=0)
        assert alone == reference.tolist(), prompt
        for draft in ("draft_model", "ngram"):
            drafted, result = greedy(client, prompt, num_draft_tokens=4, adaptive_draft=False, draft_model=draft)
            assert drafted == alone, (prompt, draft)
            if draft == "draft_model":
                accepted += result.total_accepted_draft_tokens
                rejected += result.total_draft_tokens - result.total_accepted_draft_tokens
    assert accepted > 0 and rejected > 0  # both paths of the verify, past the window of 8

