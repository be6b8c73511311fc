"""Synchronous client: gRPC streaming (ModelStreamInfer) or HTTP generate / generate_stream."""

from __future__ import annotations

import json
import queue
import time
from typing import Callable, Iterator

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from client.core import (
    ClientError, GenerationParams, GenerationResult, GenerationTimeoutError, ResultBuilder, ServerUnavailableError,
    classify_error, classify_http_error, fields_from_infer_result, server_url,
)
from specdec import tensor_names as tn

TextCallback = Callable[[str], None]
# Bytes read at a time from a streamed HTTP answer: its events arrive as they are sent whatever this is (each is
# a chunk of its own); a long event (logits: megabytes) comes in many (sse_lines joins them once).
STREAM_CHUNK = 1 << 16


def grpc_inputs(arrays: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def is_final(result) -> bool:
    param = result.get_response().parameters.get("triton_final_response")
    return bool(param and param.bool_param)


def consume_grpc_response(builder: ResultBuilder, result, error, on_text: TextCallback | None) -> bool:
    """Add one streamed gRPC response to the result; True when it was the request's last."""
    if error is not None:
        raise classify_error(error.message(), str(error.status()))
    if result.get_response().outputs:
        delta = builder.add(fields_from_infer_result(result))
        if on_text and delta:
            on_text(delta)
    return is_final(result)


class SseLines:
    """A streamed HTTP answer's lines from its bytes as they come in pieces, each piece looked at once and a
    line's pieces joined once: requests' iter_lines joins a line's pending bytes with every next piece
    (quadratic: a 20 MB event of logits took 12 s at 64 KiB pieces, 17 s at its default 512 bytes), and
    aiohttp's line reader refuses a line over 128 KiB."""

    def __init__(self):
        self.pending: list[bytes] = []

    def feed(self, piece: bytes) -> list[str]:
        """The lines this piece completes."""
        lines, start = [], 0
        while (end := piece.find(b"\n", start)) >= 0:
            self.pending.append(piece[start:end])
            lines.append(b"".join(self.pending).rstrip(b"\r").decode("utf-8"))
            self.pending, start = [], end + 1
        if start < len(piece):
            self.pending.append(piece[start:])
        return lines

    def rest(self) -> list[str]:
        """The last line, where the answer ended without a newline."""
        rest, self.pending = b"".join(self.pending), []
        return [rest.rstrip(b"\r").decode("utf-8")] if rest else []


def sse_lines(pieces) -> Iterator[str]:
    """SseLines over an iterator of pieces (a streamed HTTP answer's iter_content)."""
    lines = SseLines()
    for piece in pieces:
        yield from lines.feed(piece)
    yield from lines.rest()


def parse_sse_line(line: str) -> dict | None:
    """One Server-Sent Events line of /generate_stream: its JSON payload, or None for other lines."""
    if not line.startswith("data:"):
        return None
    payload = json.loads(line[len("data:"):])
    if "error" in payload:
        raise classify_error(payload["error"])
    return payload


def _stream_start_error(exc: InferenceServerException, responses: queue.Queue) -> ClientError:
    """The most specific error for a stream that failed while starting."""
    try:
        _, error = responses.get(timeout=2.0)
    except queue.Empty:
        error = None
    cause = error if isinstance(error, InferenceServerException) else exc
    return classify_error(cause.message(), str(cause.status()))


class Client:
    """protocol 'grpc' (url host:port, default localhost:8001) or 'http' (url host:port or http://..., 8000)."""

    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = tn.ENSEMBLE,
                 timeout_s: float = 300.0):
        self.url = server_url(url, protocol)
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s

    def is_ready(self) -> bool:
        """True when the server is up and the model is loaded."""
        try:
            if self.protocol == "grpc":
                with grpcclient.InferenceServerClient(self.url) as c:
                    return c.is_server_ready() and c.is_model_ready(self.model)
            r = requests.get(f"{self.url}/v2/models/{self.model}/ready", timeout=5)
            return r.status_code == 200
        except Exception:  # noqa: BLE001 - not ready is the answer to any failure
            return False

    def generate(self, prompt: str, params: GenerationParams | None = None, stream: bool = False,
                 on_text: TextCallback | None = None) -> GenerationResult:
        """Generate text; with stream=True, on_text receives each delta as it arrives."""
        params = params or GenerationParams()
        if self.protocol == "grpc":
            return self._grpc(prompt, params, stream, on_text)
        return self._http(prompt, params, stream, on_text)

    def _grpc(self, prompt, params, stream, on_text) -> GenerationResult:
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        builder = ResultBuilder(params.num_top_log_probs)
        try:
            try:
                client.start_stream(callback=lambda result, error: responses.put((result, error)))
                client.async_stream_infer(self.model, grpc_inputs(params.tensors(prompt, stream)),
                                          enable_empty_final_response=True)
            except InferenceServerException as exc:
                # When the stream fails before the request is sent (server down), tritonclient reports only
                # "stream is no longer in valid state" here and puts the real cause on the callback.
                raise _stream_start_error(exc, responses) from None
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    client.stop_stream(cancel_requests=True)
                    raise GenerationTimeoutError(f"no complete answer within {self.timeout_s} s") from None
                if consume_grpc_response(builder, result, error, on_text):
                    return builder.result
        finally:
            client.stop_stream()
            client.close()

    def _http(self, prompt, params, stream, on_text) -> GenerationResult:
        path = "generate_stream" if stream else "generate"
        builder = ResultBuilder(params.num_top_log_probs)
        try:
            response = requests.post(f"{self.url}/v2/models/{self.model}/{path}", json=params.json(prompt, stream),
                                     stream=stream, timeout=(10, self.timeout_s))
        except requests.ConnectionError as exc:
            raise ServerUnavailableError(f"cannot reach {self.url}: {exc}") from None
        except requests.Timeout:
            raise GenerationTimeoutError(f"no answer within {self.timeout_s} s") from None
        with response:
            if response.status_code != 200:
                raise classify_http_error(response.status_code, response.text)
            if not stream:
                builder.add(response.json())
                return builder.result
            try:
                for line in sse_lines(response.iter_content(chunk_size=STREAM_CHUNK)):
                    payload = parse_sse_line(line or "")
                    if payload is not None:
                        delta = builder.add(payload)
                        if on_text and delta:
                            on_text(delta)
            except requests.Timeout:
                raise GenerationTimeoutError(f"no complete answer within {self.timeout_s} s") from None
        return builder.result
