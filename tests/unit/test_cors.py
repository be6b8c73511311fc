"""Cross-origin requests (gateway/cors.py, vLLM's --allowed-origins and its siblings): a browser's preflight is
answered before the API key is asked for, allowed or refused naming what is not allowed, and every answer to an
allowed origin (a stream's, an error's) says so. The gateway's app runs in process in front of a stand-in for
the server (the served test: tests/integration/test_openai_api.py)."""

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from specdec import tensor_names as tn
from specdec.gateway.app import Gateway
from specdec.gateway.cors import CorsPolicy, parse_list, policy_from_flags
from specdec.gateway.upstream import Piece

PAGE = "https://chat.example.com"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


class Server:
    async def generate(self, arrays, log_probs, top=False, request_id=""):
        yield Piece(text="Hi", ids=[5], finish_reason="stop", stats={tn.NUM_INPUT_TOKENS: 3, tn.NUM_OUTPUT_TOKENS: 1})

    async def close(self):
        pass


def served(run, **gateway):
    async def main():
        async with TestClient(TestServer(Gateway(Server(), ("m",), **gateway).app())) as client:
            return await run(client)
    return asyncio.run(main())


def test_a_preflight_is_answered_before_the_api_key_is_asked_for_and_names_back_what_was_asked():
    async def run(client):
        preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        keyless = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
        keyed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                                  headers={"Origin": PAGE, "Authorization": "Bearer k"})
        return preflight, await preflight.text(), keyless, keyed, await keyed.read()

    preflight, text, keyless, keyed, body = served(run, api_key="k")
    assert preflight.status == 200 and text == "OK"
    assert preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
    assert int(preflight.headers["Access-Control-Max-Age"]) > 0
    # the refusal of a missing key, and a stream, both readable by the page
    assert keyless.status == 401 and keyless.headers["Access-Control-Allow-Origin"] == "*"
    assert keyed.status == 200 and keyed.headers["Access-Control-Allow-Origin"] == "*" and b"data: [DONE]" in body


def test_an_origin_method_or_header_not_allowed_is_refused_by_name_and_its_answers_say_nothing():
    policy = CorsPolicy(origins=(PAGE,), methods=("GET", "POST"), headers=("authorization", "content-type"))

    async def run(client):
        answers = []
        allowed = {**PREFLIGHT, "Access-Control-Request-Headers": "Content-Type"}
        for headers in ({**allowed, "Origin": "https://evil.example"},
                        {**allowed, "Access-Control-Request-Method": "DELETE"},
                        PREFLIGHT,  # x-stainless-os is not allowed
                        allowed):
            response = await client.options("/v1/chat/completions", headers=headers)
            answers.append((response.status, await response.text(), dict(response.headers)))
        other = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"})
        mine = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
        return answers, other, mine

    answers, other, mine = served(run, cors=policy)
    assert [(status, text) for status, text, _ in answers[:3]] == [
        (400, "Disallowed CORS origin"), (400, "Disallowed CORS method"), (400, "Disallowed CORS headers")]
    status, _, headers = answers[3]
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE and headers["Vary"] == "Origin"
    assert headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    # the request itself is served (a browser would not have sent it), but gives the page nothing to read
    assert other.status == 200 and "Access-Control-Allow-Origin" not in other.headers
    assert mine.headers["Access-Control-Allow-Origin"] == PAGE


def test_credentials_need_the_origin_itself_never_a_star():
    async def run(client):
        preflight = await client.options("/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
        models = await client.get("/v1/models", headers={"Origin": PAGE})
        plain = await client.get("/v1/models")  # no Origin: no CORS headers at all
        return preflight, models, plain

    preflight, models, plain = served(run, cors=CorsPolicy(credentials=True))
    for response in (preflight, models):
        assert response.headers["Access-Control-Allow-Origin"] == PAGE
        assert response.headers["Access-Control-Allow-Credentials"] == "true"
    assert "Access-Control-Allow-Origin" not in plain.headers


def test_the_flags_are_json_lists_as_vllm_takes_them():
    assert policy_from_flags('["*"]', '["get", "POST"]', '["*"]', False) == CorsPolicy(methods=("GET", "POST"))
    assert parse_list("[]", "--allowed-origins") == ()
    for text, problem in (("*", "not JSON"), ('"*"', "must be a JSON list of strings"),
                          ('["a", 1]', "must be a JSON list of strings"), ('[""]', "must be a JSON list")):
        with pytest.raises(ValueError, match=f"^--allowed-origins: {problem}"):
            policy_from_flags(text, '["*"]', '["*"]', False)
