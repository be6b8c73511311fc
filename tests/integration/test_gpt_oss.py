"""A gpt-oss-shaped pair served through the launcher (transformers' forward under the per-sequence KV cache):
layers of a sliding window and of full attention, attention sinks, experts. Greedy speculation (a draft model
that agrees with the target often, not always; prompt lookup) equals target-only decoding and transformers' own
greedy generate() token for token. The same server reads a generation_config.json of its own (--generation-config
DIR) naming a second end token (as gpt-oss's names <|call|>): it ends every request, speculative or not, over the
Triton and the OpenAI APIs; its sampling fields and --override-generation-config are the OpenAI API's defaults for
what a request leaves out, while the Triton API keeps its own. The draft is given as vLLM's --speculative-config.
Tiny random models built here (float32)."""

import json
import re

import openai
import pytest
import torch

from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.decoding.text import load_tokenizer
from specdec.serving import pairs
from specdec.serving import server as serving_server

from .helpers import READY_TIMEOUT_S, http_generate, own_gateway, stop_server

pytestmark = pytest.mark.integration

HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
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
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})  # as gpt-oss's vocabulary has them
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
                                  # (the draft given as vLLM's command line gives it)
                                  ["--target", str(tmp_path / "target"), "--speculative-config", json.dumps(
                                      {"method": "draft_model", "model": str(tmp_path / "draft"),
                                       "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}),
                                   "--generation-config", str(tmp_path / "generation"),
                                   "--override-generation-config", json.dumps({"max_new_tokens": 3}),
                                   # vLLM's engine flags, as its command line gives them (engine_flags.py)
                                   "--max-num-seqs", "8", "--enable-prefix-caching", "--tensor-parallel-size", "1",
                                   "--trust-remote-code", "--disable-log-requests", "--gpu-memory-utilization", "0.9"],
                                  ready_timeout_s=READY_TIMEOUT_S)
    yield served, references, cut, tokenizer
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
    served, references, _, _ = gpt_oss
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
    served, references, cut, _ = gpt_oss
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
    assert "--speculative-config: draft_tensor_parallel_size tune vLLM's engine, nothing here" in log
    assert "--gpu-memory-utilization, --disable-log-requests tune vLLM's or SGLang's engine, nothing here" in log
    assert "--trust-remote-code: no model's own code runs here" in log
    config = (served.run_dir / "model_repository" / "speculative_decoding" / "config.pbtxt").read_text()
    assert re.search(r'key: "max_live_sequences", value: \{ string_value: "8" \}', config)  # --max-num-seqs


def test_a_guide_and_a_thinking_budget_hold_gpt_oss_to_its_final_channel(gpt_oss):
    """reasoning_parser openai_gptoss (this tokenizer has harmony's markers as tokens, as gpt-oss's has): a guide
    holds for the final channel's message only: the tiny model, which never writes that header itself, writes
    its unconstrained greedy text under a guide; a thinking budget of 4 keeps its own first 4 tokens, forces
    <|end|><|start|>assistant<|channel|>final<|message|>, and the answer follows the guide (3 digits); budget 0
    forces the header alone. Speculative and target-only decoding give the same tokens. Through the OpenAI API
    (as vLLM serves gpt-oss: --tool-call-parser openai) the answer is the content."""
    served, references, cut, tokenizer = gpt_oss
    digits = "[0-9]{3}"  # (a random model would write JSON's whitespace to max_tokens)
    ask = {tn.MAX_TOKENS: 40, tn.GUIDED_DECODING_GUIDE_TYPE: "regex",
           tn.GUIDED_DECODING_GUIDE: digits, tn.REASONING_PARSER: "openai_gptoss",
           tn.SAMPLING_PARAMETERS: json.dumps({"skip_special_tokens": False})}  # (the ids are what is tested)

    def ids(**params) -> list[int]:
        out = [http_generate(served.http_url, PROMPTS[1], **ask, **params, **k)[tn.OUTPUT_IDS]
               for k in ({tn.NUM_DRAFT_TOKENS: 0},
                         {tn.NUM_DRAFT_TOKENS: 4, tn.ADAPTIVE_DRAFT: False, tn.DRAFT_MODEL: "draft_model"})]
        assert out[0] == out[1], params  # speculation: the same tokens
        return out[0]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert ids() == references[1][:cut]  # no final header: its own text (the generation config's end ends it)
    header = encode("<|channel|>final<|message|>")
    closing = encode("<|end|><|start|>assistant") + header
    assert len(header) == 3  # the markers are one token each
    spent = ids(**{tn.THINKING_TOKEN_BUDGET: 4})
    assert spent[:4] == references[1][:4] and spent[4:4 + len(closing)] == closing
    assert tokenizer.decode(spent[4 + len(closing):]).isdigit()
    at_once = ids(**{tn.THINKING_TOKEN_BUDGET: 0})
    assert at_once[:3] == header and len(tokenizer.decode(at_once[3:])) == 3 and tokenizer.decode(at_once[3:]).isdigit()

    api = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)
    model = api.models.list().data[0].id
    api.close()
    with own_gateway(served, model, "--tool-call-parser", "openai", "--enable-auto-tool-choice") as port:
        chat = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0, timeout=120)
        args = {"model": model, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 40,
                "temperature": 0}  # (a gateway of its own: OpenAI's defaults, not the generation config's)
        answers = [chat.chat.completions.create(**args, extra_body={"guided_regex": digits, "thinking_token_budget": 0,
                                                                    **k}).choices[0]
                   for k in ({"num_draft_tokens": 0}, {"num_draft_tokens": 4, "adaptive_draft": False})]
        assert answers[0].message.content == answers[1].message.content
        assert answers[0].message.content.isdigit() and answers[0].finish_reason == "stop"
        # no budget: the thinking runs on unconstrained (the tiny model never opens the final channel)
        free = chat.chat.completions.create(**args, extra_body={"guided_regex": digits}).choices[0]
        assert not (free.message.content or "").isdigit()
        chat.close()
