"""The gateway's stream to the server after its final response (gateway/upstream.py): never cancelled, read to
its end on a task of its own.

Triton 24.10's gRPC frontend keeps for good a request whose RPC is cancelled between its last response and
Triton's end of the RPC (measured served: 400 OpenAI clients that dropped their connection on their last
chunk left the ensemble live, the server's stop waiting its whole exit timeout; docs/api.md). Here the server's
stream is a stand-in that holds its end until told, with real tritonclient results (ModelInferResponse
messages); the RPC's cancel is what the test watches."""

import asyncio

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import InferenceServerException

from specdec import tensor_names as tn
from specdec.gateway import upstream as upstream_module
from specdec.gateway.protocol import ApiError
from specdec.gateway.upstream import Upstream


def response(text: str = "", final: bool = False) -> InferResult:
    """A response of the ensemble: `text` (none: an empty response, as enable_empty_final_response sends)."""
    message = service_pb2.ModelInferResponse(model_name=tn.ENSEMBLE)
    if text:
        encoded = text.encode()
        message.outputs.add(name=tn.TEXT_OUTPUT, datatype="BYTES", shape=[1])
        message.raw_output_contents.append(len(encoded).to_bytes(4, "little") + encoded)
        message.outputs.add(name=tn.OUTPUT_IDS, datatype="INT32", shape=[1])
        message.raw_output_contents.append(np.array([7], "<i4").tobytes())
    message.parameters["triton_final_response"].bool_param = final
    return InferResult(message)


class Stream:
    """tritonclient.grpc.aio's stream as the gateway reads it: `items` (result, error) in order, then its end
    once `end` is set (Triton ends the RPC a moment after its last response); `cancelled` counts cancels."""

    def __init__(self, items):
        self.items, self.end, self.cancelled, self.ended = list(items), asyncio.Event(), 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        await self.end.wait()
        self.ended = True
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled += 1
        return True


def upstream_of(stream: Stream) -> Upstream:
    upstream = Upstream("localhost:1")

    class Client:
        def stream_infer(self, requests):
            return stream

    upstream._client = Client()
    return upstream


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main, 10))  # a stream waited on for ever fails, not hangs


async def drained(stream: Stream) -> None:
    stream.end.set()
    for _ in range(100):
        if not upstream_module._READING_OUT:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the stream was not read out")


def test_a_caller_that_leaves_on_the_final_piece_cancels_nothing():
    async def main():
        stream = Stream([(response("Hello"), None), (response(" world", final=True), None)])
        pieces = upstream_of(stream).generate({}, log_probs=False)
        assert (await pieces.__anext__()).text == "Hello"
        assert (await pieces.__anext__()).text == " world"
        await pieces.aclose()  # the client disconnected on its last chunk
        assert stream.cancelled == 0 and not stream.ended
        await drained(stream)
        assert stream.ended and stream.cancelled == 0

    run(main())


def test_an_empty_final_response_ends_generation_without_waiting_for_the_end_of_the_rpc():
    async def main():
        stream = Stream([(response("Hello"), None), (response(final=True), None)])
        pieces = [piece.text async for piece in upstream_of(stream).generate({}, log_probs=False)]
        assert pieces == ["Hello"] and not stream.ended  # the end is still held: generation did not wait
        await drained(stream)
        assert stream.cancelled == 0

    run(main())


def test_a_caller_that_leaves_before_the_final_response_cancels_the_request():
    async def main():
        stream = Stream([(response("Hello"), None), (response(" more"), None), (response(final=True), None)])
        pieces = upstream_of(stream).generate({}, log_probs=False)
        await pieces.__anext__()
        await pieces.aclose()
        assert stream.cancelled == 1 and not upstream_module._READING_OUT

    run(main())


def test_an_error_response_is_raised_and_its_stream_read_out_not_cancelled():
    async def main():
        stream = Stream([(None, InferenceServerException("in[0]: invalid argument")), (response(final=True), None)])
        with pytest.raises(ApiError) as raised:
            async for _ in upstream_of(stream).generate({}, log_probs=False):
                pass
        assert raised.value.status == 400 and stream.cancelled == 0
        await drained(stream)
        assert stream.ended and stream.cancelled == 0

    run(main())


def test_a_stream_that_triton_never_ends_is_cancelled_after_the_read_out_timeout(monkeypatch):
    monkeypatch.setattr(upstream_module, "READ_OUT_TIMEOUT_S", 0.1)

    async def main():
        stream = Stream([(response("Hello", final=True), None)])
        assert [piece.text async for piece in upstream_of(stream).generate({}, log_probs=False)] == ["Hello"]
        await asyncio.sleep(0.3)
        assert stream.cancelled == 1 and not stream.ended and not upstream_module._READING_OUT

    run(main())


def test_closing_waits_for_the_streams_being_read_out():
    async def main():
        stream = Stream([(response("Hello", final=True), None)])
        upstream = upstream_of(stream)
        closed = []

        class Client(type(upstream._client)):
            async def close(self):
                closed.append(stream.ended)

        upstream._client = Client()
        assert [piece.text async for piece in upstream.generate({}, log_probs=False)] == ["Hello"]
        closing = asyncio.ensure_future(upstream.close())
        await asyncio.sleep(0.05)
        assert not closing.done()  # the stream has not ended: the channel stays open
        stream.end.set()
        await closing
        assert closed == [True] and stream.cancelled == 0

    run(main())


# ---- direct: preprocessing, then speculative_decoding (what the launcher's gateway calls) ----------------------
TAKEN = {tn.PREPROCESSING: (tn.MESSAGES, tn.MAX_TOKENS, tn.STREAM),  # stand-ins for their configs'
         tn.SPECULATIVE_DECODING: (tn.INPUT_IDS, tn.MAX_TOKENS, tn.TEMPERATURE, tn.STREAM, tn.RETURN_PROMPT_IDS)}


class DirectClient:
    """The server as the direct path calls it: preprocessing answers `ids` (or raises `refusal`), the stream is
    `stream`; every call is recorded."""

    def __init__(self, stream: Stream, ids=(5, 6, 7), refusal: InferenceServerException | None = None):
        self.stream, self.ids, self.refusal, self.calls = stream, ids, refusal, []

    async def get_model_config(self, model, as_json=False):
        self.calls.append(("config", model))
        return {"config": {"name": model, "input": [{"name": name} for name in TAKEN[model]]}}

    async def infer(self, model, inputs, outputs=None, request_id=""):
        self.calls.append(("infer", model, sorted(each.name() for each in inputs), request_id))
        if self.refusal is not None:
            raise self.refusal
        message = service_pb2.ModelInferResponse(model_name=model)
        message.outputs.add(name=tn.INPUT_IDS, datatype="INT32", shape=[1, len(self.ids)])
        message.raw_output_contents.append(np.array(self.ids, "<i4").tobytes())
        return InferResult(message)

    def stream_infer(self, requests):
        async def sent():
            async for request in requests:
                self.calls.append(("stream", request["model_name"],
                                   {each.name(): each for each in request["inputs"]}, request["request_id"]))
        self.reading = asyncio.ensure_future(sent())
        return self.stream


def direct_upstream(client: DirectClient) -> Upstream:
    upstream = Upstream("localhost:1", direct=True)
    upstream._client = client
    return upstream


ARRAYS = {tn.MESSAGES: np.array([[b'[{"role": "user", "content": "Hi"}]']], dtype=np.object_),
          tn.MAX_TOKENS: np.array([[8]], dtype=np.int32), tn.STREAM: np.array([[True]]),
          tn.RETURN_PROMPT_IDS: np.array([[True]])}  # (speculative_decoding's alone)


def test_direct_sends_every_input_to_preprocessing_and_its_ids_with_the_generations_own_to_speculative_decoding():
    async def main():
        client = DirectClient(None)
        upstream = direct_upstream(client)
        assert upstream.models == (tn.PREPROCESSING, tn.SPECULATIVE_DECODING)
        for _ in range(2):
            client.stream = Stream([(response("Hello"), None), (response(final=True), None)])
            assert [p.text async for p in upstream.generate(dict(ARRAYS), log_probs=False, request_id="r")] \
                == ["Hello"]
            await drained(client.stream)
        kinds = [call[:2] for call in client.calls]
        # their inputs asked once; each request: preprocessing, then the stream
        assert kinds == [("config", tn.PREPROCESSING), ("infer", tn.PREPROCESSING), ("config", tn.SPECULATIVE_DECODING),
                         ("stream", tn.SPECULATIVE_DECODING), ("infer", tn.PREPROCESSING),
                         ("stream", tn.SPECULATIVE_DECODING)]
        assert client.calls[1][2:] == (sorted((tn.MESSAGES, tn.MAX_TOKENS, tn.STREAM)), "r")
        sent, request_id = client.calls[3][2:]
        assert sorted(sent) == sorted((tn.INPUT_IDS, tn.MAX_TOKENS, tn.STREAM, tn.RETURN_PROMPT_IDS))
        assert request_id == "r"
        assert sent[tn.INPUT_IDS].shape() == [1, 3] and sent[tn.INPUT_IDS].datatype() == "INT32"

    run(main())


@pytest.mark.parametrize("status, code", [("StatusCode.INVALID_ARGUMENT", 400), ("StatusCode.UNAVAILABLE", 503),
                                          ("StatusCode.NOT_FOUND", 503)])
def test_a_refusal_of_preprocessing_is_the_requests_error_and_nothing_is_generated(status, code):
    async def main():
        refusal = InferenceServerException("preprocessing: input 'messages' must be a non-empty JSON list",
                                           status=status)
        client = DirectClient(Stream([]), refusal=refusal)
        with pytest.raises(ApiError) as raised:
            async for _ in direct_upstream(client).generate(dict(ARRAYS), log_probs=False):
                pass
        assert raised.value.status == code and not any(call[0] == "stream" for call in client.calls)
        if code == 400:
            assert raised.value.param == "messages"

    run(main())
