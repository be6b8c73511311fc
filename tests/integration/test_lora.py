"""LoRA adapters served (engine/lora.py): the session's tiny pair serves one (`pairs.TINY_LORA`), and two more
from its directory of adapters (`pairs.TINY_LORA_LIBRARY`, read on demand into one slot). A request that
names one generates what the target with the adapter merged into its weights generates (transformers,
float64, in process), speculating or not, over gRPC, HTTP, the OpenAI API and vLLM's sampling_parameters;
a name the server does not serve is refused naming the field, and the server goes on serving."""

import json
import queue
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient

from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.engine import lora
from specdec.serving.pairs import TINY_LORA, TINY_LORA_LIBRARY

from .helpers import GenerationError, ensemble_inputs, grpc_stream, http_generate
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
            # K fixed: the adaptive policy, pricing rounds on a loaded 2-core machine, may draft nothing at all
            # (seen in CI: the draft-token count below then stays 0)
            got = grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=k, end_id=0,
                              draft_model=_name(draft), adaptive_draft=False, **{tn.LORA_NAME: _name(TINY_LORA)})
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
    refused = f"input '{tn.LORA_NAME}': no LoRA adapter 'nope' \\(served: {TINY_LORA}; none in .*lora-library\\)"
    with pytest.raises(GenerationError, match=refused):
        grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=4, **{tn.LORA_NAME: _name("nope")})
    with pytest.raises(Exception, match="'lora_name': no LoRA adapter 'nope'"):
        http_generate(server.http_url, PROMPTS[0], **{tn.SAMPLING_PARAMETERS: json.dumps({"lora_name": "nope"})})
    got = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=16, num_draft_tokens=4, end_id=0,
                      **{tn.LORA_NAME: _name(TINY_LORA)})  # and it goes on serving
    assert got[tn.TEXT_OUTPUT] == merged_greedy(PROMPTS[0], 16)


def _merged_greedy_of(server, name: str, where: Path | None = None):
    """Greedy text (transformers) of the served target with the directory's adapter `name` (or the adapter at
    `where`) merged in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _rendered_parameter(server, "target_model", "model_path")
    directory = Path(_rendered_parameter(server, "target_model", "lora_directory"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapter = lora.load_adapter(name, where or directory / name, model)
    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            getattr(getattr(model.model.layers[layer], lora.MODULES[module][0]), module).weight += b @ a

    def run(prompt: str, n: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)

    return run


def test_a_directorys_adapters_are_read_on_demand_and_take_turns_in_their_slot(server, merged_greedy):
    """The directory's two adapters share one slot (max_loras 2, the served adapter's held for good): each
    request's text is its adapter's, one after the other (each read again over the other) and at once (one
    waits for the slot, as a request waits for KV room), and the OpenAI API lists them as models."""
    from concurrent.futures import ThreadPoolExecutor

    want = {name: _merged_greedy_of(server, name) for name in TINY_LORA_LIBRARY}
    first, second = TINY_LORA_LIBRARY
    texts = {name: {prompt: want[name](prompt, 16) for prompt in PROMPTS} for name in TINY_LORA_LIBRARY}
    assert texts[first] != texts[second]

    def generate(name: str, prompt: str, tokens: int = 16) -> str:
        return grpc_stream(server.grpc_url, prompt, max_tokens=tokens, num_draft_tokens=4, end_id=0,
                           **{tn.LORA_NAME: _name(name)})[tn.TEXT_OUTPUT]

    rejected = server.metric("specdec_requests_total", finish_reason="rejected")
    loads = server.metric("specdec_model_lora_loads_total", model="target_model")
    for prompt in PROMPTS:  # a, b, a, ...: each read into the slot the other held
        for name in (first, second):
            assert generate(name, prompt) == texts[name][prompt], (name, prompt)
    # each read once per request (the counter is added to as the sequences end, after their last response)
    deadline = time.monotonic() + 10
    while server.metric("specdec_model_lora_loads_total", model="target_model") - loads < 2 * len(PROMPTS) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("specdec_model_lora_loads_total", model="target_model") - loads == 2 * len(PROMPTS)
    # at once, with the served adapter and the base model beside them: the one whose first step finds the slot
    # held by the other's running request waits for it
    jobs = [(name, prompt) for prompt in PROMPTS for name in (first, second, TINY_LORA, "")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: generate(*job), jobs))
    for (name, prompt), text in zip(jobs, got):
        expected = texts[name][prompt] if name in texts else merged_greedy(prompt, 16, adapted=name == TINY_LORA)
        assert text == expected, (name, prompt)
    assert server.metric("specdec_requests_total", finish_reason="rejected") == rejected
    # while a long request runs the one, a request for the other waits for it to end (its slot freed), then
    # generates its own text
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((time.monotonic(), result, error)))
    try:
        client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(PROMPTS[0], max_tokens=300, num_draft_tokens=0, stream=True,
                                                               ignore_eos=True, **{tn.LORA_NAME: _name(first)}),
                                  enable_empty_final_response=True)
        _, started, error = responses.get(timeout=60)  # it runs: its first tokens are out
        assert error is None and started.get_response().outputs, error
        assert generate(second, PROMPTS[1]) == texts[second][PROMPTS[1]]
        waited_until = time.monotonic()
        streamed = [responses.get(timeout=60)]
        while not streamed[-1][1].get_response().parameters["triton_final_response"].bool_param:
            streamed.append(responses.get(timeout=60))
        assert all(error is None for _, _, error in streamed) and len(streamed) > 100
        assert streamed[-1][0] <= waited_until  # the long request had ended when the other's was answered
    finally:
        client.stop_stream()
        client.close()
    # a name of the directory's that is no adapter, or that would leave it: refused naming the field
    for name in ("nope", "../tiny-lora-a"):
        with pytest.raises(GenerationError, match=f"input '{tn.LORA_NAME}': no LoRA adapter"):
            grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=4, **{tn.LORA_NAME: _name(name)})
    # the OpenAI API: the directory's adapters are models of their names, their base the parent
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
    try:
        cards = {card.id: card for card in client.models.list().data}
        base = next(iter(cards))
        assert [*cards][1:] == [TINY_LORA, *TINY_LORA_LIBRARY]
        assert all(cards[name].model_extra["parent"] == base for name in TINY_LORA_LIBRARY)
        text = client.completions.create(model=second, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert text == texts[second][PROMPTS[1]]
    finally:
        client.close()


def test_adapters_loaded_and_unloaded_while_serving_through_vllms_endpoints(server, tmp_path):
    """POST /v1/load_lora_adapter (the session's server allows it): an adapter from outside the directory is a
    model of its name, its text the merged model's, listed; load_inplace another in its place: the next
    request's text is the other's; one the target cannot serve (its rank above max_lora_rank): refused naming
    its path, and not served; unloaded: refused as a model, a second unload 404, the directory as it was."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(_rendered_parameter(server, "target_model", "model_path"),
                                                  dtype=torch.float64)
    paths = {}
    for name, rank, seed in (("first", 4, 101), ("second", 4, 102), ("wide", 32, 103)):
        paths[name] = tmp_path / name
        lora.save_adapter(paths[name], lora.random_adapter(target, rank=rank, seed=seed, std=0.2), rank=rank,
                          alpha=2 * rank)
    runs = {name: _merged_greedy_of(server, name, paths[name]) for name in ("first", "second")}
    want = {name: run(PROMPTS[0], 12) for name, run in runs.items()}
    assert want["first"] != want["second"]
    name = "runtime-lora"
    http = requests.Session()
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def load(path: Path, **extra) -> requests.Response:
        return post("load_lora_adapter", lora_path=str(path), **extra)

    def post(endpoint: str, **body) -> requests.Response:
        return http.post(f"{server.openai_url}/{endpoint}", json={"lora_name": name, **body}, timeout=120)

    before = [card.id for card in client.models.list().data]
    try:
        answer = load(paths["first"])
        assert (answer.status_code, answer.text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
        assert complete(name) == want["first"]
        cards = {card.id: card for card in client.models.list().data}
        assert cards[name].model_extra["parent"] == before[0]
        again = load(paths["second"])
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        assert load(paths["second"], load_inplace=True).status_code == 200
        assert complete(name) == want["second"]
        # grpc too: the name is a lora_name the orchestrator admits
        assert grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=12, ignore_eos=True, num_draft_tokens=4,
                           **{tn.LORA_NAME: _name(name)})[tn.TEXT_OUTPUT] == want["second"]
        # unloaded while a request runs it: that request finishes with it
        stream = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=300, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        pieces = [next(stream).choices[0].text]
        unloaded = post("unload_lora_adapter")
        assert (unloaded.status_code, unloaded.text) == (200, f"Success: LoRA adapter '{name}' removed successfully.")
        after = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert len(after) > 10 and "".join(pieces + after) == runs["second"](PROMPTS[1], 300)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            complete(name)
        with pytest.raises(GenerationError, match=f"input '{tn.LORA_NAME}': no LoRA adapter"):
            grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=4, **{tn.LORA_NAME: _name(name)})
        assert post("unload_lora_adapter").status_code == 404
        # the target refuses what it cannot serve: named with its path, the name not served
        wide = load(paths["wide"])
        assert wide.status_code == 400, wide.text
        message = wide.json()["error"]["message"]
        assert str(paths["wide"]) in message and "has rank 32; max_lora_rank is 16" in message, message
        assert [card.id for card in client.models.list().data] == before
    finally:
        post("unload_lora_adapter")
        http.close()
        client.close()


def test_a_draft_made_of_the_targets_layers_drafts_with_the_requests_adapter(server, merged_greedy):
    """draft_model_exact is the target's own weights (lora_layers first): it runs a request's adapter too, so
    an adapter's requests accept every token it drafts, as the base model's do; the served adapter and one
    its directory holds (read on demand by the draft as by the target) alike."""
    for adapter in (TINY_LORA, TINY_LORA_LIBRARY[0]):
        for prompt in PROMPTS[:2]:
            got = grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=4, adaptive_draft=False,
                              end_id=0, draft_model=_name("draft_model_exact"), **{tn.LORA_NAME: _name(adapter)})
            assert got[tn.TOTAL_DRAFT_TOKENS] > 0 and got[tn.ACCEPTANCE_RATE] == 1.0, (adapter, prompt, got)
            if adapter == TINY_LORA:
                assert got[tn.TEXT_OUTPUT] == merged_greedy(prompt, 16)
    assert _rendered_parameter(server, "draft_model_exact", "lora_layers") == "first"
