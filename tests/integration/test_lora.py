"""LoRA adapters served (engine/lora.py): the session's tiny pair serves one (`pairs.TINY_LORA`). A request
that names it generates what the target with the adapter merged into its weights generates (transformers,
float64, in process), speculating or not, over gRPC, HTTP, the OpenAI API and vLLM's sampling_parameters;
a name the server does not serve is refused naming the field, and the server goes on serving."""

import json

import numpy as np
import openai
import pytest
import torch

from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.engine import lora
from specdec.serving.pairs import TINY_LORA

from .helpers import GenerationError, grpc_stream, http_generate
from .test_generation_api import _rendered_parameter

PROMPTS = ["The quick brown fox", "In the beginning", "def fibonacci(n):"]


def _name(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


@pytest.fixture(scope="module")
def merged_greedy(server):
    """Greedy text of the served target with the served adapter merged into its weights (transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _rendered_parameter(server, "target_model", "model_path")
    rendered = _rendered_parameter(server, "target_model", "lora_adapters")
    adapters = dict(pair.split("=", 1) for pair in rendered.split(","))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapter = lora.load_adapter(TINY_LORA, adapters[TINY_LORA], model)  # B scaled: W + B A
    base = {}
    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            linear = getattr(getattr(model.model.layers[layer], lora.MODULES[module][0]), module)
            base[(layer, module)] = linear.weight.clone()
            linear.weight += b @ a

    def run(prompt: str, n: int, adapted: bool = True) -> str:
        with torch.no_grad():
            if not adapted:
                saved = {}
                for (layer, module), weight in base.items():
                    linear = getattr(getattr(model.model.layers[layer], lora.MODULES[module][0]), module)
                    saved[(layer, module)] = linear.weight.clone()
                    linear.weight.copy_(weight)
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            if not adapted:
                for (layer, module), weight in saved.items():
                    getattr(getattr(model.model.layers[layer], lora.MODULES[module][0]), module).weight.copy_(weight)
        return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)

    return run


def test_an_adapters_requests_generate_the_adapted_models_text_speculating_or_not(server, merged_greedy):
    before = {name: server.metric(name, lora_name=TINY_LORA) for name in
              ("specdec_lora_requests_total", "specdec_lora_output_tokens_total", "specdec_lora_draft_tokens_total")}
    for prompt in PROMPTS:
        want = merged_greedy(prompt, 16)
        assert want != merged_greedy(prompt, 16, adapted=False), prompt  # the adapter changes the text
        for draft, k in (("draft_model", 0), ("draft_model", 4), ("draft_model_exact", 4), ("ngram", 4)):
            got = grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=k, end_id=0,
                              draft_model=_name(draft), **{tn.LORA_NAME: _name(TINY_LORA)})
            assert got[tn.TEXT_OUTPUT] == want, (prompt, draft, k)
        base = grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=4, end_id=0)
        assert base[tn.TEXT_OUTPUT] == merged_greedy(prompt, 16, adapted=False), prompt  # beside it: the base model's
    # Triton's generate extension, and vLLM's key in sampling_parameters
    got = http_generate(server.http_url, PROMPTS[0], max_tokens=16, num_draft_tokens=4, end_id=0,
                        **{tn.LORA_NAME: TINY_LORA})
    assert got[tn.TEXT_OUTPUT] == merged_greedy(PROMPTS[0], 16)
    got = http_generate(server.http_url, PROMPTS[1], end_id=0, **{
        tn.SAMPLING_PARAMETERS: json.dumps({"max_tokens": 16, "lora_name": TINY_LORA})})
    assert got[tn.TEXT_OUTPUT] == merged_greedy(PROMPTS[1], 16)
    # the project's client, over HTTP and streamed over gRPC
    params = GenerationParams(max_tokens=16, num_draft_tokens=4, end_id=0, lora_name=TINY_LORA)
    for protocol, stream in (("http", False), ("grpc", True)):
        url = server.http_url if protocol == "http" else server.grpc_url
        assert Client(url, protocol).generate(PROMPTS[2], params, stream=stream).text == merged_greedy(PROMPTS[2], 16)
    # per adapter: its requests (4 draft settings x 3 prompts + 4), their tokens, what they drafted
    after = {name: server.metric(name, lora_name=TINY_LORA) for name in before}
    assert after["specdec_lora_requests_total"] - before["specdec_lora_requests_total"] == 16
    assert after["specdec_lora_output_tokens_total"] - before["specdec_lora_output_tokens_total"] == 16 * 16
    assert after["specdec_lora_draft_tokens_total"] > before["specdec_lora_draft_tokens_total"]


def test_the_openai_api_serves_an_adapter_as_a_model_of_its_name(server, merged_greedy):
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
    try:
        cards = {card.id: card for card in client.models.list().data}
        base = next(iter(cards))
        assert TINY_LORA in cards and cards[TINY_LORA].model_extra["parent"] == base
        for model, adapted in ((TINY_LORA, True), (base, False)):
            text = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
            assert text == merged_greedy(PROMPTS[2], 12, adapted=adapted), model
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)
    finally:
        client.close()


def test_an_adapter_the_server_does_not_serve_is_refused_naming_the_field(server, merged_greedy):
    refused = f"input '{tn.LORA_NAME}': no LoRA adapter 'nope' \\(served: {TINY_LORA}\\)"
    with pytest.raises(GenerationError, match=refused):
        grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=4, **{tn.LORA_NAME: _name("nope")})
    with pytest.raises(Exception, match="'lora_name': no LoRA adapter 'nope'"):
        http_generate(server.http_url, PROMPTS[0], **{tn.SAMPLING_PARAMETERS: json.dumps({"lora_name": "nope"})})
    got = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=16, num_draft_tokens=4, end_id=0,
                      **{tn.LORA_NAME: _name(TINY_LORA)})  # and it goes on serving
    assert got[tn.TEXT_OUTPUT] == merged_greedy(PROMPTS[0], 16)
