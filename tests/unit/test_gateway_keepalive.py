"""A streamed answer kept alive while it waits (gateway/app.py `Gateway._waited`): past the keepalive its SSE
headers go out and a comment line each keepalive after, which every API's SDK skips; an error after that is
the stream's error event in the API's own form. The gateway's app runs in process in front of a stand-in for
the server whose first response is late (the served tests: tests/integration/test_openai_api.py)."""

import asyncio

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from specdec import tensor_names as tn
from specdec.gateway.app import KEEPALIVE, Gateway
from specdec.gateway.protocol import ApiError
from specdec.gateway.upstream import Piece

KEEPALIVE_S = 0.05
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
MESSAGE = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
RESPONSE = {"model": "m", "input": "Hi", "max_output_tokens": 4, "stream": True, "store": False}


class LateServer:
    """The server's stand-in: its first response after `wait` seconds (or, with `error`, that refusal)."""

    def __init__(self, wait: float, error: ApiError | None = None):
        self.wait, self.error = wait, error

    async def generate(self, arrays, log_probs, top=False, request_id=""):
        await asyncio.sleep(self.wait)
        if self.error is not None:
            raise self.error
        yield Piece(text="Hello", ids=[5], stats={tn.NUM_INPUT_TOKENS: 3})
        yield Piece(text=" there", ids=[6], finish_reason="stop", stats={tn.NUM_INPUT_TOKENS: 3, tn.NUM_OUTPUT_TOKENS: 2})

    async def close(self):
        pass


def served(upstream, run, keepalive_s=KEEPALIVE_S):
    """run(client, base URL) against the gateway's app in front of `upstream`."""
    async def main():
        gateway = Gateway(upstream, ("m",), keepalive_s=keepalive_s)
        async with TestClient(TestServer(gateway.app())) as client:
            return await run(client, str(client.make_url("")).rstrip("/"))
    return asyncio.run(main())


async def raw(client, path: str, body: dict) -> tuple[int, bytes]:
    response = await client.post(path, json=body)
    return response.status, await response.read()


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGE),
                                       ("/v1/responses", RESPONSE)])
def test_a_late_first_token_is_kept_alive_with_comment_lines(path, body):
    status, data = served(LateServer(6 * KEEPALIVE_S), lambda client, _: raw(client, path, body))
    assert status == 200 and data.startswith(KEEPALIVE * 2)  # one each keepalive while it waited
    events = data.replace(KEEPALIVE, b"")
    assert KEEPALIVE not in events and b"Hello" in events and b" there" in events
    # answered at once: no comment line
    status, data = served(LateServer(0), lambda client, _: raw(client, path, body))
    assert status == 200 and KEEPALIVE not in data and b" there" in data


def test_the_sdks_read_a_kept_alive_stream_as_any_other():
    async def run(_client, url):
        chat = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in await chat.chat.completions.create(
            **CHAT) if chunk.choices])
        claude = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        async with claude.messages.stream(**{k: v for k, v in MESSAGE.items() if k != "stream"}) as stream:
            message = await stream.get_final_message()
        await chat.close()
        await claude.close()
        return text, message.content[0].text
    assert served(LateServer(4 * KEEPALIVE_S), run) == ("Hello there", "Hello there")


@pytest.mark.parametrize("path,body,event", [
    ("/v1/chat/completions", CHAT, b'data: {"error":{"message":'),
    ("/v1/messages", MESSAGE, b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"'),
    ("/v1/responses", RESPONSE, b'event: error\ndata: {"type":"error","sequence_number":0,"code":'),
])
def test_an_error_after_the_keepalive_is_the_streams_error_event(path, body, event):
    """A refusal that comes after the headers went out is the API's error event (the status said 200); one
    that comes before is the HTTP error it always was."""
    full = ApiError(503, "the server is full; retry later", code="overloaded")
    status, data = served(LateServer(4 * KEEPALIVE_S, full), lambda client, _: raw(client, path, body))
    assert status == 200 and data.startswith(KEEPALIVE) and event in data and b"retry later" in data
    assert data.endswith(b"data: [DONE]\n\n") == (path == "/v1/chat/completions")
    status, data = served(LateServer(0, full), lambda client, _: raw(client, path, body))
    assert status == 503 and KEEPALIVE not in data and b"retry later" in data


def test_the_sdk_raises_the_error_event_and_a_whole_answer_is_never_kept_alive():
    async def run(client, url):
        chat = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="retry later"):
            async for _ in await chat.chat.completions.create(**CHAT):
                pass
        await chat.close()
        return await raw(client, "/v1/chat/completions", {**CHAT, "stream": False})
    status, data = served(LateServer(4 * KEEPALIVE_S, ApiError(503, "full; retry later")), run)
    assert status == 503 and KEEPALIVE not in data  # the JSON answer keeps its status


def test_keepalive_zero_is_off():
    status, data = served(LateServer(4 * KEEPALIVE_S), lambda client, _: raw(client, "/v1/chat/completions", CHAT),
                          keepalive_s=0)
    assert status == 200 and KEEPALIVE not in data and b" there" in data
