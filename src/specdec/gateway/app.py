"""The OpenAI-compatible HTTP API (aiohttp): /v1/chat/completions, /v1/completions, /v1/models, /health.

Each request becomes one gRPC stream of the ensemble (upstream.py); a streamed answer goes out as
Server-Sent Events chunk by chunk as the server accepts tokens. A client that goes away (before its first
token or mid-stream) cancels its handler (aiohttp's handler_cancellation), which closes the upstream
iterator, which cancels the request on the server.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from typing import Callable

from aiohttp import web

from specdec import tensor_names as tn
from specdec.gateway import protocol
from specdec.gateway.protocol import STATS, STATS_FIELD, ApiError, Generation
from specdec.gateway.upstream import Piece, Upstream

TokenText = Callable[[int], str]  # a token id's text (for log-probabilities)
API_PREFIX = "/v1/"
HEALTH_PATH = "/health"


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


class Gateway:
    def __init__(self, upstream: Upstream, served: tuple[str, ...], token_text: TokenText | None,
                 api_key: str | None = None):
        self.upstream, self.served, self.token_text, self.api_key = upstream, served, token_text, api_key
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get(HEALTH_PATH, self.health)
        app.on_cleanup.append(lambda _app: self.upstream.close())
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        if self.api_key and request.path.startswith(API_PREFIX):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return error_response(ApiError(401, "Incorrect API key provided (Authorization: Bearer <key>)",
                                               code="invalid_api_key"))
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
            raise

    async def _body(self, request: web.Request) -> dict:
        try:
            return await request.json()
        except ValueError as exc:
            raise ApiError(400, f"the request body is not JSON ({exc})") from None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, protocol.parse_chat(await self._body(request), self.served))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, protocol.parse_completion(await self._body(request), self.served))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(name) for name in self.served]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.served:
            raise ApiError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
        return web.json_response(self._model_card(name))

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specdec"}

    async def health(self, request: web.Request) -> web.Response:
        if await self.upstream.ready():
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"not ready: {tn.ENSEMBLE} at {self.upstream.url}\n")

    # ---- answers --------------------------------------------------------------------------------------------
    def _logprobs(self, gen: Generation, piece: Piece, offset: int) -> dict | None:
        if not gen.logprobs:
            return None
        text = self.token_text or (lambda token: f"token_id:{token}")
        return protocol.logprobs_object(gen.chat, [text(t) for t in piece.ids], piece.log_probs, offset)

    @staticmethod
    def _finish_reason(piece: Piece) -> str | None:
        if piece.finish_reason == tn.FINISH_CANCELLED:  # not a reason OpenAI's clients know
            raise ApiError(503, "the server cancelled the generation (it is stopping); retry", code="cancelled")
        return piece.finish_reason or None

    async def _answer(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        pieces = self.upstream.generate(gen.inputs, gen.logprobs)
        async with contextlib.aclosing(pieces):
            first = await anext(pieces, None)  # errors before the first token are plain HTTP errors
            if gen.stream:
                return await self._stream(request, gen, first, pieces)
            return await self._whole(gen, first, pieces)

    async def _whole(self, gen: Generation, first: Piece | None, pieces) -> web.Response:
        merged = Piece()
        async for piece in _chain(first, pieces):
            merged.text += piece.text
            merged.ids += piece.ids
            merged.log_probs += piece.log_probs
            merged.finish_reason = piece.finish_reason or merged.finish_reason
            merged.stats.update(piece.stats)
        choice = protocol.choice(gen, merged.text, self._finish_reason(merged), self._logprobs(gen, merged, 0),
                                 delta=False)
        body = protocol.envelope(gen, [choice], chunk=False)
        body["usage"] = _usage(merged.stats, len(merged.ids))
        body[STATS_FIELD] = _stats(merged.stats)
        return web.json_response(body)

    async def _stream(self, request: web.Request, gen: Generation, first: Piece | None, pieces) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        if gen.chat:  # the role chunk, sent with the first token so that a client's TTFT stays honest
            await response.write(protocol.sse(protocol.envelope(gen, [protocol.choice(gen, "", None, None, True, first=True)],
                                                                chunk=True)))
        sent_text, sent_ids, stats = 0, 0, {}
        try:
            async for piece in _chain(first, pieces):
                stats.update(piece.stats)
                sent_ids += len(piece.ids)
                reason = self._finish_reason(piece)
                if not piece.text and not reason and not (gen.logprobs and piece.ids):
                    continue  # nothing to tell (e.g. text held back at a possible stop word)
                chunk = protocol.envelope(gen, [protocol.choice(gen, piece.text, reason,
                                                                self._logprobs(gen, piece, sent_text), True)], chunk=True)
                sent_text += len(piece.text)
                if gen.include_usage:
                    chunk["usage"] = _usage(stats, sent_ids) if gen.continuous_usage else None
                if reason:
                    chunk[STATS_FIELD] = _stats(stats)
                await response.write(protocol.sse(chunk))
            if gen.include_usage:
                final = protocol.envelope(gen, [], chunk=True)
                final["usage"] = _usage(stats, sent_ids)
                await response.write(protocol.sse(final))
        except ApiError as exc:  # after the stream began: an error event, as OpenAI's SDK reads one
            await response.write(protocol.sse(exc.body()))
        await response.write(protocol.sse("[DONE]"))
        await response.write_eof()
        return response


async def _chain(first: Piece | None, rest):
    if first is not None:
        yield first
        async for piece in rest:
            yield piece


def _usage(stats: dict, completion_tokens: int) -> dict:
    """Usage so far: the server's counts where it sent them (the last response carries them all), else the
    tokens received."""
    return protocol.usage(int(stats.get(tn.NUM_INPUT_TOKENS, 0)),
                          max(completion_tokens, int(stats.get(tn.NUM_OUTPUT_TOKENS, 0))))


def _stats(stats: dict) -> dict:
    return {name: stats[name] for name in STATS if name in stats}


def token_text_from(tokenizer) -> TokenText:
    """A token's text as OpenAI's log-probabilities show it (the token decoded alone)."""
    return lambda token: tokenizer.decode([token])
