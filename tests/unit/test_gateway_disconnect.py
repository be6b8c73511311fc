"""A client that leaves in the middle of its stream (gateway/app.py `Gateway._counted`): where its stream is
written before aiohttp cancels the handler, the write fails (ConnectionResetError); that is a disconnection,
counted as one, the server's stream is closed, and nothing is logged as an error (it logged aiohttp's "Error
handling request" with a traceback and counted a 500). The gateway's app runs in process in front of a
stand-in for the server that sends its second response only once the client has gone; aiohttp's test server
does not cancel handlers, so every such write fails as a production server's does when it writes first. A
connection reset that is not the client's leaving stays a 500."""

import asyncio
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer

from specdec import tensor_names as tn
from specdec.gateway import metrics
from specdec.gateway.app import Gateway
from specdec.gateway.upstream import Piece
from specdec.serving.metrics_text import sum_samples

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
COMPLETION = {"model": "m", "prompt": "Hi", "max_tokens": 8, "stream": True}
MESSAGE = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
RESPONSE = {"model": "m", "input": "Hi", "max_output_tokens": 8, "stream": True, "store": False}


class ServerAfterTheClientLeft:
    """The server's stand-in: a first response, the rest once `gone` is set; `closed` once its stream ends."""

    def __init__(self):
        self.gone, self.closed = asyncio.Event(), asyncio.Event()

    async def generate(self, arrays, log_probs, top=False, request_id=""):
        try:
            yield Piece(text="Hello", ids=[5], stats={tn.NUM_INPUT_TOKENS: 3})
            await self.gone.wait()
            for token in range(6, 12):
                yield Piece(text=" more", ids=[token])
            yield Piece(text=".", ids=[12], finish_reason="length",
                        stats={tn.NUM_INPUT_TOKENS: 3, tn.NUM_OUTPUT_TOKENS: 8})
        finally:
            self.closed.set()

    async def close(self):
        pass


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                       ("/v1/messages", MESSAGE), ("/v1/responses", RESPONSE)])
def test_a_client_gone_mid_stream_is_a_disconnection_not_an_error(path, body, caplog):
    upstream = ServerAfterTheClientLeft()

    async def main():
        gateway = Gateway(upstream, ("m",))
        async with TestClient(TestServer(gateway.app())) as client:
            response = await client.post(path, json=body)
            assert response.status == 200
            assert b"Hello" in await response.content.readuntil(b"Hello")  # the first response's event
            response.close()  # the client leaves (its connection closed)
            upstream.gone.set()
            await asyncio.wait_for(upstream.closed.wait(), 10)
            for _ in range(100):  # the handler's end: its request counted
                page = gateway.metrics.page().decode()
                if sum_samples(page, "specdec_openai_requests_running") == 0:
                    break
                await asyncio.sleep(0.01)
            return page

    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        page = asyncio.run(main())
    assert sum_samples(page, "specdec_openai_requests_total", endpoint=path, code=metrics.DISCONNECTED) == 1
    assert sum_samples(page, "specdec_openai_requests_total", endpoint=path, code="500") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


class ServerConnectionReset:
    """A stand-in whose stream fails with a ConnectionResetError of its own (not the client's)."""

    async def generate(self, arrays, log_probs, top=False, request_id=""):
        raise ConnectionResetError("the server's connection")
        yield  # (an async generator, as the server's stream is)

    async def close(self):
        pass


def test_a_connection_reset_that_is_not_the_clients_stays_a_500():
    async def main():
        gateway = Gateway(ServerConnectionReset(), ("m",))
        async with TestClient(TestServer(gateway.app())) as client:
            response = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
            return response.status, gateway.metrics.page().decode()

    status, page = asyncio.run(main())
    assert status == 500
    assert sum_samples(page, "specdec_openai_requests_total", endpoint="/v1/chat/completions", code="500") == 1
    assert sum_samples(page, "specdec_openai_requests_total", code=metrics.DISCONNECTED) == 0
