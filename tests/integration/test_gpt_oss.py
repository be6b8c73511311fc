"""A gpt-oss-shaped pair served through the launcher (transformers' forward under the per-sequence KV cache):
layers of a sliding window and of full attention, attention sinks, experts. Greedy speculation (a draft model
that agrees with the target often, not always; prompt lookup) equals target-only decoding and transformers' own
greedy generate() token for token. The same server reads a generation_config.json of its own (--generation-config
DIR) naming a second end token (as gpt-oss's names <|call|>): it ends every request, speculative or not, over the
Triton and the OpenAI APIs; its sampling fields and --override-generation-config are the OpenAI API's defaults for
what a request leaves out, while the Triton API keeps its own. Tiny random models built here (float32)."""

import json

import openai
import pytest
import torch

from client import Client, GenerationParams
from specdec.decoding.text import load_tokenizer
from specdec.serving import pairs
from specdec.serving import server as serving_server

from .helpers import READY_TIMEOUT_S, stop_server

pytestmark = pytest.mark.integration

PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat sat on the", "Hello there, how are"]


def build(directory, tokenizer, seed: int, noise: float = 0.0):
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024,
                          layer_types=["sliding_attention", "full_attention"],
                          eos_token_id=tokenizer.eos_token_id,
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
    build(tmp_path / "draft", tokenizer, seed=3, noise=0.5)  # the target, its head perturbed
    target.set_attn_implementation("eager")  # transformers' attention with sinks, as the reference
    references = [reference(target, tokenizer, prompt) for prompt in PROMPTS]
    # A second end token: the first token the target writes at position >= 5 for PROMPTS[1] that it had not
    # written before (found with transformers' generate(), before the server starts)
    written = references[1]
    cut = next(i for i in range(5, len(written)) if written[i] not in written[:i])
    assert tokenizer.eos_token_id not in written[:cut + 1]
    (tmp_path / "generation").mkdir()
    (tmp_path / "generation" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tokenizer.eos_token_id, written[cut]], "temperature": 0.0, "max_new_tokens": 12}))
    served = serving_server.start(tmp_path / "run", tmp_path / "server.log",
                                  ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                                   "--generation-config", str(tmp_path / "generation"),
                                   "--override-generation-config", json.dumps({"max_new_tokens": 3})],
                                  ready_timeout_s=READY_TIMEOUT_S)
    yield served, references, cut
    stop_server(served)


def reference(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()


def greedy(client: Client, prompt: str, **params) -> tuple[list[int], object]:
    result = client.generate(prompt, GenerationParams(max_tokens=40, return_log_probs=True, num_top_log_probs=1,
                                                      ignore_eos=True, **params))
    return [top[0] for top in result.top_ids], result


def test_greedy_speculation_equals_target_only_and_transformers_generate(gpt_oss):
    served, references, _ = gpt_oss
    client = Client(served.grpc_url, "grpc")
    accepted = rejected = 0
    for prompt, expected in zip(PROMPTS, references):
        alone, _ = greedy(client, prompt, num_draft_tokens=0)  # (ignore_eos: no end token ends it)
        assert alone == expected, prompt
        for draft in ("draft_model", "ngram"):
            drafted, result = greedy(client, prompt, num_draft_tokens=4, adaptive_draft=False, draft_model=draft)
            assert drafted == alone, (prompt, draft)
            if draft == "draft_model":
                accepted += result.total_accepted_draft_tokens
                rejected += result.total_draft_tokens - result.total_accepted_draft_tokens
    assert accepted > 0 and rejected > 0  # both paths of the verify, past the window of 8


def test_the_generation_configs_end_tokens_end_requests_and_its_sampling_fields_are_the_openai_apis_defaults(gpt_oss):
    served, references, cut = gpt_oss
    written = references[1]
    client = Client(served.grpc_url, "grpc")
    for params in ({"num_draft_tokens": 0}, {"num_draft_tokens": 4, "adaptive_draft": False}):
        result = client.generate(PROMPTS[1], GenerationParams(max_tokens=40, return_log_probs=True,
                                                              num_top_log_probs=1, **params))
        assert [top[0] for top in result.top_ids] == written[:cut] and result.finish_reason == "stop", params
    # a request's own end id replaces them; the Triton API's defaults stay its own (greedy, its max_tokens)
    own = client.generate(PROMPTS[1], GenerationParams(max_tokens=40, end_id=0, num_draft_tokens=0))
    assert own.num_output_tokens == 40
    assert client.generate(PROMPTS[1], GenerationParams(num_draft_tokens=0)).num_output_tokens == cut  # (cut > 3)

    api = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)
    model = api.models.list().data[0].id
    three = client.generate(PROMPTS[1], GenerationParams(max_tokens=3, num_draft_tokens=0)).text
    # a request that says nothing: greedy (the file's temperature 0) for 3 tokens (the override's max_new_tokens)
    plain = api.completions.create(model=model, prompt=PROMPTS[1])
    assert (plain.choices[0].text, plain.choices[0].finish_reason, plain.usage.completion_tokens) == \
        (three, "length", 3)
    longer = api.completions.create(model=model, prompt=PROMPTS[1], max_tokens=40, logprobs=1)
    assert longer.choices[0].finish_reason == "stop" and len(longer.choices[0].logprobs.tokens) == cut
    response = api.responses.create(model=model, input="Hi", max_output_tokens=4)
    assert response.temperature == 0.0  # the echo says what was used
    api.close()
    log = served.log_path.read_text(errors="replace")
    assert "sampling defaults of a request that leaves them out: {'temperature': 0.0, 'max_tokens': 3}" in log
