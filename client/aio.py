"""asyncio client: many concurrent requests from one event loop (gRPC streaming via tritonclient.grpc.aio,
HTTP via aiohttp)."""

from __future__ import annotations

import asyncio

import aiohttp
import tritonclient.grpc.aio as grpcaio

from client.core import (
    ClientError, GenerationParams, GenerationResult, GenerationTimeoutError, ResultBuilder, ServerUnavailableError,
    classify_error, classify_http_error, server_url,
)
from client.sync import SseLines, TextCallback, consume_grpc_response, grpc_inputs, parse_sse_line
from specdec import tensor_names as tn


class AsyncClient:
    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = tn.ENSEMBLE,
                 timeout_s: float = 300.0):
        self.url = server_url(url, protocol)
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        self._grpc = grpcaio.InferenceServerClient(self.url) if protocol == "grpc" else None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        if self._grpc is not None:
            await self._grpc.close()
        if self._http is not None:
            await self._http.close()

    async def generate(self, prompt: str, params: GenerationParams | None = None, stream: bool = False,
                       on_text: TextCallback | None = None) -> GenerationResult:
        params = params or GenerationParams()
        try:
            run = self._generate_grpc if self.protocol == "grpc" else self._generate_http
            return await asyncio.wait_for(run(prompt, params, stream, on_text), self.timeout_s)
        except asyncio.TimeoutError:
            raise GenerationTimeoutError(f"no complete answer within {self.timeout_s} s") from None

    async def _generate_grpc(self, prompt, params, stream, on_text) -> GenerationResult:
        request = {"model_name": self.model, "inputs": grpc_inputs(params.tensors(prompt, stream)),
                   "enable_empty_final_response": True}

        async def requests_iter():
            yield request

        builder = ResultBuilder(params.num_top_log_probs)
        responses = self._grpc.stream_infer(requests_iter())
        failure = None
        finished = False
        try:
            # Read the stream to its natural end, also after the final response or an error: cancelling
            # the RPC between Triton's last response and its end of the RPC leaves the request in
            # Triton 24.10's gRPC frontend for good (its memory, and the model never unloads: api.md).
            async for result, error in responses:
                if finished:
                    continue
                try:
                    finished = consume_grpc_response(builder, result, error, on_text)
                except ClientError as exc:
                    failure = failure or exc
        except asyncio.CancelledError:
            responses.cancel()  # timeout or caller cancelled: tell the server
            raise
        except Exception as exc:  # noqa: BLE001 - transport failures
            raise classify_error(str(exc)) from None
        if failure is not None:
            raise failure
        return builder.result

    async def _generate_http(self, prompt, params, stream, on_text) -> GenerationResult:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        path = "generate_stream" if stream else "generate"
        builder = ResultBuilder(params.num_top_log_probs)
        try:
            async with self._http.post(f"{self.url}/v2/models/{self.model}/{path}",
                                       json=params.json(prompt, stream)) as response:
                if response.status != 200:
                    raise classify_http_error(response.status, await response.text())
                if not stream:
                    builder.add(await response.json())
                    return builder.result
                lines = SseLines()
                async for piece in response.content.iter_any():
                    for line in lines.feed(piece):
                        payload = parse_sse_line(line.strip())
                        if payload is not None:
                            delta = builder.add(payload)
                            if on_text and delta:
                                on_text(delta)
        except aiohttp.ClientConnectionError as exc:
            raise ServerUnavailableError(f"cannot reach {self.url}: {exc}") from None
        return builder.result
