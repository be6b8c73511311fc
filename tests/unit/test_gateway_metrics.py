"""The OpenAI API's own metrics (gateway/metrics.py): what a request, its streams and the stores count. The
served endpoint and its middleware: tests/integration/test_openai_api.py."""

import asyncio
import contextvars

from specdec import tensor_names as tn
from specdec.gateway import metrics
from specdec.gateway.response_store import ResponseStore, SharedResponseStore
from specdec.gateway.upstream import Piece
from specdec.serving.metrics_text import sum_samples

ROUTE = dict(method="POST", endpoint="/v1/completions")


def value(api: metrics.ApiMetrics, name: str, **labels) -> float:
    return sum_samples(api.page().decode(), name, **labels)


def in_own_context(function, *args):
    """As a request's handler runs: in a context of its own (aiohttp runs each in a task)."""
    return contextvars.copy_context().run(function, *args)


def test_a_request_is_counted_with_its_code_and_time():
    api = metrics.ApiMetrics()

    def request(code, stream_error=None):
        call = api.begin("POST", "/v1/completions")
        assert value(api, "specdec_openai_requests_running", **ROUTE) == 1
        if stream_error is not None:
            api.stream_error(stream_error)
        api.end(call, code)

    for code, error in ((200, None), (400, None), (200, 503), (metrics.DISCONNECTED, 503)):
        in_own_context(request, code, error)
    assert value(api, "specdec_openai_requests_running", **ROUTE) == 0
    assert value(api, "specdec_openai_requests_total", **ROUTE, code="200") == 1
    assert value(api, "specdec_openai_requests_total", **ROUTE, code="400") == 1
    # an error event after the stream began counts with its status; a client gone first stays disconnected
    assert value(api, "specdec_openai_requests_total", **ROUTE, code="503") == 1
    assert value(api, "specdec_openai_requests_total", **ROUTE, code="disconnected") == 1
    assert value(api, "specdec_openai_request_duration_seconds_count", **ROUTE) == 4
    in_own_context(lambda: api.end(api.begin("BREW", metrics.UNMATCHED), 404))  # a method no API knows
    assert value(api, "specdec_openai_requests_total", method="other", endpoint="unmatched", code="404") == 1


async def _pieces(pieces, closed: list):
    try:
        for piece in pieces:
            yield piece
    finally:
        closed.append(True)


def test_a_generations_tokens_and_first_token_are_counted_under_its_request():
    api = metrics.ApiMetrics()
    stats = {tn.NUM_INPUT_TOKENS: 7, tn.NUM_OUTPUT_TOKENS: 5, tn.NUM_CACHED_TOKENS: 4}
    pieces = [Piece(), Piece(ids=[1, 2]), Piece(ids=[3]), Piece(ids=[4, 5], stats=stats, finish_reason="length")]

    async def request(n_choices, leave_after=None):
        call = api.begin("POST", "/v1/completions")
        closed = []
        for index in range(n_choices):  # a choice's prompt counted once: the first choice's
            stream = api.counted(_pieces(pieces, closed), prompt=index == 0)
            async for i, _ in _aenumerate(stream):
                if i == leave_after:
                    break
            await stream.aclose()
        api.end(call, 200)
        return closed

    assert asyncio.run(request(2)) == [True, True]
    assert value(api, "specdec_openai_completion_tokens_total", **ROUTE) == 10
    assert value(api, "specdec_openai_prompt_tokens_total", **ROUTE) == 7
    assert value(api, "specdec_openai_cached_prompt_tokens_total", **ROUTE) == 4  # of those, the prefix cache's
    assert value(api, "specdec_openai_time_to_first_token_seconds_count", **ROUTE) == 1  # once per request
    # a stream left early (the client went away) is closed; its tokens so far count, no prompt was seen yet
    assert asyncio.run(request(1, leave_after=1)) == [True]
    assert value(api, "specdec_openai_completion_tokens_total", **ROUTE) == 12
    assert value(api, "specdec_openai_prompt_tokens_total", **ROUTE) == 7
    assert value(api, "specdec_openai_time_to_first_token_seconds_count", **ROUTE) == 2
    # no tokens at all (a prompt scored only): no first token
    asyncio.run(_drain(api, [Piece(stats=stats)]))
    assert value(api, "specdec_openai_time_to_first_token_seconds_count", **ROUTE) == 2


async def _drain(api, pieces):
    call = api.begin("POST", "/v1/completions")
    async for _ in api.counted(_pieces(pieces, [])):
        pass
    api.end(call, 200)


async def _aenumerate(stream):
    i = 0
    async for item in stream:
        yield i, item
        i += 1


class _Background:
    def __init__(self, running: int):
        self.running = running

    def __len__(self):
        return self.running


def test_the_stored_and_background_responses_are_read_when_scraped(tmp_path):
    response = {"id": "resp_1", "object": "response", "output": []}
    for store in (ResponseStore(1 << 20), SharedResponseStore(tmp_path / "shared", 1 << 20)):
        api = metrics.ApiMetrics(store, _Background(2))
        assert value(api, "specdec_openai_stored_responses") == 0
        store.put(response, [{"role": "user", "content": "hi"}], None)
        store.put(dict(response, id="resp_2"), [{"role": "user", "content": "hello there"}], "resp_1")
        count, size = store.usage()
        assert count == 2 and size > 0
        assert value(api, "specdec_openai_stored_responses") == 2
        assert value(api, "specdec_openai_stored_response_bytes") == size
        assert value(api, "specdec_openai_background_responses") == 2
        store.delete("resp_1")
        assert value(api, "specdec_openai_stored_responses") == 1
        assert value(api, "specdec_openai_stored_response_bytes") < size
    conversations = ResponseStore(1 << 20)
    conversations.put({"id": "conv_1", "object": "conversation"}, [], None, [{"id": "msg_1", "type": "message"}])
    api = metrics.ApiMetrics(conversations=conversations)
    assert value(api, "specdec_openai_conversations") == 1
    assert value(api, "specdec_openai_conversation_bytes") == conversations.usage()[1] > 0
    files = ResponseStore(1 << 20)
    files.put({"id": "file-1", "object": "file"}, [], None, [{"content": "{}\n"}])
    api = metrics.ApiMetrics(files=files, batches=_Background(1))
    assert value(api, "specdec_openai_files") == 1 and value(api, "specdec_openai_file_bytes") == files.usage()[1]
    assert value(api, "specdec_openai_batches_running") == 1
    # another process's files count too: the directory is what is listed
    other = SharedResponseStore(tmp_path / "shared", 1 << 20)
    assert other.usage() == store.usage()
    # a store that keeps nothing reports nothing
    assert "stored_responses" not in metrics.ApiMetrics(ResponseStore(0), _Background(0)).page().decode()
