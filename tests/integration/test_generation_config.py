"""The model's generation_config.json on a real server (tiny pair, through the launcher): every end token it names
ends a request, speculative or not, over the Triton API and the OpenAI API (as transformers' generate() and vLLM
end it); its sampling fields and --override-generation-config are the OpenAI API's defaults for a request that
leaves them out, while the Triton API keeps its own (greedy, the server's max_tokens)."""

import json

import openai
import pytest

from client import Client, GenerationParams
from specdec.decoding.text import load_tokenizer
from specdec.serving import pairs
from specdec.serving import server as serving_server

from .helpers import READY_TIMEOUT_S, stop_server

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox"


def greedy_ids(client: Client, max_tokens: int | None, **params) -> list[int]:
    """The tokens a greedy request generated (each position's most likely token is the one chosen)."""
    result = client.generate(PROMPT, GenerationParams(max_tokens=max_tokens, return_log_probs=True,
                                                      num_top_log_probs=1, **params))
    return [top[0] for top in result.top_ids], result


def test_the_files_end_tokens_end_every_request_and_its_sampling_fields_are_the_openai_apis_defaults(server,
                                                                                                      tmp_path):
    # What the tiny target writes greedily, from the session's server (no end token but the tokenizer's)
    ids, _ = greedy_ids(Client(server.grpc_url, "grpc"), 16, num_draft_tokens=0, ignore_eos=True)
    eos = load_tokenizer(pairs.tiny_pair().tokenizer_path).eos_token_id
    cut = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])  # a token first written at position cut
    assert eos not in ids[:cut + 1], ids
    three = Client(server.grpc_url, "grpc").generate(PROMPT, GenerationParams(max_tokens=3, num_draft_tokens=0)).text
    (directory := tmp_path / "generation").mkdir()
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, ids[cut]],
                                                                  "temperature": 0.0, "max_new_tokens": 12}))
    own = serving_server.start(tmp_path / "run", tmp_path / "server.log",
                               ["--pair", "tiny", "--generation-config", str(directory),
                                "--override-generation-config", json.dumps({"max_new_tokens": 3})],
                               ready_timeout_s=READY_TIMEOUT_S)
    try:
        client = Client(own.grpc_url, "grpc")
        for params in ({"num_draft_tokens": 0}, {"num_draft_tokens": 3, "adaptive_draft": False}):
            got, result = greedy_ids(client, 16, **params)
            assert got == ids[:cut] and result.finish_reason == "stop", (params, got, ids, cut)
        # ignore_eos ends at none of them; a request's own end id replaces them
        assert greedy_ids(client, 16, num_draft_tokens=0, ignore_eos=True)[0] == ids
        assert greedy_ids(client, 16, num_draft_tokens=0, end_id=eos)[0] == ids

        api = openai.OpenAI(base_url=own.openai_url, api_key="unused", max_retries=0, timeout=120)
        model = api.models.list().data[0].id
        # a request that says nothing: greedy (the file's temperature 0) for 3 tokens (the override's max_new_tokens)
        plain = api.completions.create(model=model, prompt=PROMPT)
        assert (plain.choices[0].text, plain.choices[0].finish_reason, plain.usage.completion_tokens) == \
            (three, "length", 3)
        # one that says how long: ends at the file's end token, as the Triton API's did
        longer = api.completions.create(model=model, prompt=PROMPT, max_tokens=16, logprobs=1)
        assert longer.choices[0].finish_reason == "stop" and len(longer.choices[0].logprobs.tokens) == cut
        chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
        assert chat.usage.completion_tokens <= 3
        response = api.responses.create(model=model, input="Hi", max_output_tokens=4)
        assert response.temperature == 0.0  # the echo says what was used
        # the Triton API keeps its defaults: greedy, the server's max_tokens (the file's end token still ends it)
        assert greedy_ids(client, None, num_draft_tokens=0)[0] == ids[:cut]  # (cut > 3)
        api.close()
    finally:
        stop_server(own)
    log = own.log_path.read_text(errors="replace")
    assert "sampling defaults of a request that leaves them out: {'temperature': 0.0, 'max_tokens': 3}" in log
