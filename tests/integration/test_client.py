"""The client library and command line against the real server, over gRPC and HTTP."""

import asyncio
import subprocess
import sys

import pytest

from client import (AsyncClient, Client, GenerationParams, InvalidArgumentError, ModelNotReadyError,
                    ServerUnavailableError)

from specdec.serving.server import free_ports

from .helpers import grpc_stream

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, in a land far away,"
# A fixed K: the adaptive rule (the server's default) pauses a draft that does not pay for its measured
# costs, and these tests read what the client reports of drafted tokens
# (a priority orders requests only while the server is full: here it changes nothing, but must reach it)
PARAMS = GenerationParams(max_tokens=20, num_draft_tokens=3, adaptive_draft=False, priority=3)


@pytest.fixture(scope="module")
def reference(server):
    return grpc_stream(server.grpc_url, PROMPT, max_tokens=20, num_draft_tokens=3, adaptive_draft=False)["text_output"]


def urls(server):
    return {"grpc": server.grpc_url, "http": server.http_url}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
def test_generate_sync(server, reference, protocol, stream):
    deltas = []
    client = Client(urls(server)[protocol], protocol)
    assert client.is_ready()
    result = client.generate(PROMPT, PARAMS, stream=stream, on_text=deltas.append)
    assert result.text == reference
    assert result.finish_reason == "length" and result.num_output_tokens == 20
    assert result.total_draft_tokens > 0 and 0 <= result.acceptance_rate <= 1
    assert 0 < result.ttft_s <= result.latency_s and result.tokens_per_s > 0
    if stream:
        assert len(deltas) > 1 and "".join(deltas) == reference
        assert result.itl_s > 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_asyncio_client_drives_concurrent_requests(server, reference, protocol):
    async def run():
        async with AsyncClient(urls(server)[protocol], protocol) as client:
            return await asyncio.gather(*(client.generate(PROMPT, PARAMS, stream=bool(i % 2)) for i in range(6)))

    for result in asyncio.run(run()):
        assert result.text == reference


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_invalid_argument_carries_the_server_message(server, protocol):
    client = Client(urls(server)[protocol], protocol)
    with pytest.raises(InvalidArgumentError, match="top_p"):
        client.generate(PROMPT, GenerationParams(top_p=2.0))

    async def run():
        async with AsyncClient(urls(server)[protocol], protocol) as aclient:
            await aclient.generate(PROMPT, GenerationParams(temperature=-1.0), stream=True)

    with pytest.raises(InvalidArgumentError, match="temperature"):
        asyncio.run(run())


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unknown_model_is_not_ready(server, protocol):
    client = Client(urls(server)[protocol], protocol, model="no_such_model")
    assert not client.is_ready()
    with pytest.raises(ModelNotReadyError):
        client.generate(PROMPT, PARAMS)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_server_down(protocol):
    port = free_ports(1)[0]
    client = Client(f"localhost:{port}", protocol, timeout_s=20)
    with pytest.raises(ServerUnavailableError):
        client.generate(PROMPT, PARAMS)


def test_server_down_found_after_the_stream_failed():
    """The race behind a flaky CI run: tritonclient's stream thread already saw "connection refused" when
    the request is sent, so the send only says "stream is no longer in valid state"; the client must still
    report the server as down, from the callback's error."""
    import queue
    import time

    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from client.sync import _stream_start_error

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"localhost:{free_ports(1)[0]}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    deadline = time.monotonic() + 10
    while responses.empty() and time.monotonic() < deadline:  # wait for the stream thread's error
        time.sleep(0.02)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=object))
    with pytest.raises(InferenceServerException, match="no longer in valid state") as raised:
        client.async_stream_infer("ensemble", [text])
    assert isinstance(_stream_start_error(raised.value, responses), ServerUnavailableError)
    client.stop_stream()
    client.close()


def test_timeout(server):
    from client import GenerationTimeoutError

    client = Client(server.grpc_url, "grpc", timeout_s=0.05)
    with pytest.raises(GenerationTimeoutError):
        client.generate(PROMPT, GenerationParams(max_tokens=200, num_draft_tokens=2))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_command_line_streams_text_and_prints_stats(server, reference, protocol):
    out = subprocess.run([sys.executable, "-m", "client", PROMPT, "--stream", "--protocol", protocol,
                          "--url", urls(server)[protocol], "--max-tokens", "20", "--num-draft-tokens", "3",
                          "--priority", "-2",
                          # a JSON guide after a thinking the tiny model never ends: the text is its own
                          "--guide-type", "json", "--reasoning-parser", "deepseek_r1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == reference
    assert "tokens/s" in out.stderr and "acceptance" in out.stderr and "TTFT" in out.stderr


def test_command_line_reports_errors(server):
    out = subprocess.run([sys.executable, "-m", "client", PROMPT, "--url", server.grpc_url, "--top-p", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "InvalidArgumentError" in out.stderr and "top_p" in out.stderr
    # wider trees than the server's draft_branches (1 here): refused by name
    out = subprocess.run([sys.executable, "-m", "client", PROMPT, "--url", server.grpc_url, "--num-draft-branches", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "num_draft_branches" in out.stderr, out.stderr
