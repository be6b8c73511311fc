"""The OpenAI-compatible HTTP API (aiohttp): /v1/chat/completions, /v1/completions, /v1/responses (and its
stored responses, /v1/responses/{id}), /v1/models, /health, its Prometheus metrics (/metrics, metrics.py),
vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and Anthropic's Messages API
(/v1/messages, /v1/messages/count_tokens: messages.py).

Each request becomes one gRPC stream of the ensemble (upstream.py); a streamed answer goes out as
Server-Sent Events chunk by chunk as the server accepts tokens. A client that goes away (before its first
token or mid-stream) cancels its handler (aiohttp's handler_cancellation), which closes the upstream
iterator, which cancels the request on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import time
import uuid
from dataclasses import replace
from importlib import metadata
from typing import Callable

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from specdec import tensor_names as tn
from specdec.decoding import json_text
from specdec.decoding.text import token_bytes, token_text
from specdec.engine.lora_config import slot_count
from specdec.gateway import (adapters, batches, conversations, messages, metrics, protocol, reasoning, responses,
                             sglang_native, tokenization, tools, vllm_metrics)
from specdec.gateway.protocol import STATS_FIELD, ApiError, Generation
from specdec.gateway.background import BackgroundResponses
from specdec.gateway.cors import CorsPolicy
from specdec.gateway.response_store import NotStored, ResponseStore, in_store
from specdec.gateway.upstream import Piece, Upstream
from specdec.triton import cache_reset, live_profile

TokenText = Callable[[int], str]  # a token id's text (for log-probabilities)
API_PREFIX = "/v1/"
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})  # vLLM's, at the root
# vLLM's (its development mode's): the server's caches across requests reset (cache_reset.py); behind the key
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
RESET_FLAGS = ("reset_running_requests", "reset_external")  # its query's flags: both mean the same here
# vLLM's and SGLang's: torch profiler traces of the models' executions, started and stopped (live_profile.py);
# POST, and GET as SGLang's; behind the key. The answers' texts are SGLang's, the stop's naming the traces.
START_PROFILE_PATH, STOP_PROFILE_PATH = "/start_profile", "/stop_profile"
PROFILE_STARTED, PROFILE_STOPPED = "Start profiling.\n", "Stop profiling.\n"
PROFILE_STOP_WAIT_S = 300.0  # how long a stop waits for the traces to be written before it answers
KEYED_PATHS = frozenset({RESET_PREFIX_CACHE_PATH, START_PROFILE_PATH, STOP_PROFILE_PATH})  # beside /v1's
# A boolean query value as FastAPI (vLLM's server) spells it, either way
QUERY_BOOLEANS = frozenset({"true", "1", "yes", "on", "t", "y", "false", "0", "no", "off", "f", "n"})
HEALTH_PATH = "/health"
MAX_BODY_MIB = 16  # a request body's limit (a long prompt or conversation); over it: 413 naming it
# SageMaker's container contract, as vLLM serves it: GET /ping is the health check, POST /invocations an answer
PING_PATH, INVOCATIONS_PATH = "/ping", "/invocations"
try:  # pyproject.toml's, as installed (GET /version)
    VERSION = metadata.version("specdec")
except metadata.PackageNotFoundError:  # run from a source tree without installing it
    VERSION = "unknown"
MESSAGES_PREFIX = "/v1/messages"  # Anthropic's API: its errors in its own form
RESPONSES_PREFIX = "/v1/responses"
KEEPALIVE_S = 15.0  # a streamed answer silent this long gets a comment line (Gateway._waited); 0: never
KEEPALIVE = b": keepalive\n\n"  # an SSE comment: every client's parser skips it
_PREPARED = web.RequestKey("specdec_event_stream", web.StreamResponse)  # a request's SSE response, once prepared
_REQUEST_ID = web.RequestKey("specdec_request_id", str)  # a chat's or completion's id (Generation.id)


def error_response(error: ApiError, path: str = "") -> web.Response:
    body = messages.error_body(error) if path.startswith(MESSAGES_PREFIX) else error.body()
    return web.json_response(body, status=error.status)


class Gateway:
    def __init__(self, upstream: Upstream, served: tuple[str, ...], tokenizer=None, api_key: str | None = None,
                 tool_parser: str | None = None, max_model_len: int = 0, reasoning_parser: str | None = None,
                 store: ResponseStore | None = None, default_max_tokens: int = 0, drain_timeout_s: float = 60.0,
                 keepalive_s: float = KEEPALIVE_S, runtime_lora: bool = False,
                 log: Callable[[str], None] = lambda message: None, trust_templates: bool = False,
                 sampling_defaults: dict | None = None, cors: CorsPolicy = CorsPolicy(), content_format: str = "auto",
                 server_metrics_url: str = "", max_loras: int = 0, cache_reset_file: str = "",
                 incremental_streaming: bool = False, profile: tuple[str, str] = ("", "")):
        """tokenizer: the target's (a transformers tokenizer), for the text of log-probabilities' tokens and of
        echoed token-id prompts, and the tokenizer endpoints; None: tokens show as `token_id:N`, and those
        need it. max_model_len: the server's context in tokens (model cards, /tokenize; 0: not known).
        store: the Responses API's stored responses (None: none are kept). default_max_tokens: what the server
        generates for a request that does not say (what `truncation: auto` leaves room for; 0: not known).
        drain_timeout_s: how long a stop waits for background responses to finish (then they fail).
        keepalive_s: how long a streamed answer may be silent before a comment line keeps its connection
        (`_waited`; 0: never). runtime_lora: vLLM's load_lora_adapter and unload_lora_adapter (adapters.py;
        `served` must have a directory of adapters). log: where what changes the served models is written.
        trust_templates: a request's own chat template is passed on (the server must take it too), else refused.
        sampling_defaults: what a request that leaves sampling fields out gets besides OpenAI's defaults (the
        model's generation config, generation_config.sampling_defaults; None: OpenAI's alone). cors: which
        browser pages may call it (cors.py; default: any, as vLLM's). content_format: how the server hands a
        message's content to the chat template (text.CONTENT_FORMATS), for counting prompts as it renders them.
        server_metrics_url: the server's metrics port (host:port), whose figures /metrics restates under vLLM's
        names ("": none). max_loras: the target's (0: its default, lora_config.slot_count). cache_reset_file: the
        marker through which a client resets the server's caches (cache_reset.py; "": no reset).
        incremental_streaming: SGLang's --incremental-streaming-output (a streamed /generate event holds what it
        adds, not the output so far). profile: the control file through which clients start and stop the
        models' torch profiles, and the traces' default directory (live_profile.py; "": not served)."""
        served = served if isinstance(served, protocol.Served) else protocol.Served(served)  # (tests: a tuple)
        self.upstream, self.served, self.tokenizer, self.api_key = upstream, served, tokenizer, api_key
        self.token_bytes = token_bytes(tokenizer) if tokenizer is not None else None
        self.token_text: TokenText | None = token_text(tokenizer, self.token_bytes) if tokenizer is not None else None
        self.tool_parser = tool_parser  # tools.PARSERS: how the model writes calls (tool_choice "auto")
        self.trust_templates, self.content_format = trust_templates, content_format
        self.server_metrics_url, self.cache_reset_file = server_metrics_url, cache_reset_file
        self.incremental_streaming = incremental_streaming
        self.profile_control_file, self.profile_dir = profile
        self.max_loras = slot_count(max_loras, len(served.adapters), served.directory)  # the target's adapter slots
        self.sampling_defaults = {**protocol.DEFAULT_SAMPLING, **(sampling_defaults or {})}
        self.cors = cors
        # reasoning.PARSERS: a chat's thinking apart (None: not split); the openai tool-call parser implies its own
        self.reasoning_parser = tools.reasoning_for(tool_parser, reasoning_parser)
        self.max_model_len, self.default_max_tokens = max_model_len, default_max_tokens
        self.keepalive_s = keepalive_s
        self.store = store if store is not None else ResponseStore(0)
        self.conversations = conversations.Conversations(self.store.sibling("conversations"))
        self.background = BackgroundResponses(self.store, self._background_answer, drain_timeout_s,
                                              ended=self._add_to_conversation)
        self.files = batches.Files(self.store.sibling("files"))
        self.batches = batches.Batches(self.store.sibling("batches"), self.files, self._batch_answer, drain_timeout_s)
        self.metrics = metrics.ApiMetrics(self.store, self.background, self.conversations.store, self.files.contents,
                                          self.batches)
        self.created = int(time.time())
        self._generated_at: tuple[float, float] | None = None  # (time, the server's tokens) at the last server info
        self.runtime_adapters = adapters.RuntimeAdapters(served) if runtime_lora else None
        self.log = log

    def app(self) -> web.Application:
        # CORS first: a browser's preflight is answered before the API key is asked for (it never carries one)
        app = web.Application(middlewares=[self.cors.middleware(), self._counted, self._errors],
                              client_max_size=MAX_BODY_MIB * 1024 * 1024)
        app.on_response_prepare.append(self.cors.on_prepare)
        app.on_response_prepare.append(_request_id_header)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{id}", self.stored_response)
        app.router.add_delete("/v1/responses/{id}", self.delete_response)
        app.router.add_get("/v1/responses/{id}/input_items", self.stored_input_items)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel_response)
        app.router.add_post("/v1/conversations", self.create_conversation)
        app.router.add_get("/v1/conversations/{id}", self.get_conversation)
        app.router.add_post("/v1/conversations/{id}", self.update_conversation)
        app.router.add_delete("/v1/conversations/{id}", self.delete_conversation)
        app.router.add_get("/v1/conversations/{id}/items", self.list_conversation_items)
        app.router.add_post("/v1/conversations/{id}/items", self.add_conversation_items)
        app.router.add_get("/v1/conversations/{id}/items/{item}", self.get_conversation_item)
        app.router.add_delete("/v1/conversations/{id}/items/{item}", self.delete_conversation_item)
        app.router.add_post("/v1/files", self.create_file)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{id}", self.get_file)
        app.router.add_get("/v1/files/{id}/content", self.file_content)
        app.router.add_delete("/v1/files/{id}", self.delete_file)
        app.router.add_post("/v1/batches", self.create_batch)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{id}", self.get_batch)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel_batch)
        app.router.add_post(MESSAGES_PREFIX, self.messages)
        app.router.add_post(MESSAGES_PREFIX + "/count_tokens", self.count_message_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        if self.runtime_adapters is not None:  # vLLM's: not there unless allowed
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get(HEALTH_PATH, self.health)
        app.router.add_post(sglang_native.GENERATE_PATH, self.sglang_generate)
        for path in sglang_native.SERVER_INFO_PATHS:
            app.router.add_get(path, self.sglang_server_info)
        for path in sglang_native.MODEL_INFO_PATHS:
            app.router.add_get(path, self.sglang_model_info)
        app.router.add_get(sglang_native.HEALTH_GENERATE_PATH, self.health_generate)
        app.router.add_route("GET", sglang_native.FLUSH_CACHE_PATH, self.flush_cache)
        app.router.add_post(sglang_native.FLUSH_CACHE_PATH, self.flush_cache)
        app.router.add_post(RESET_PREFIX_CACHE_PATH, self.reset_prefix_cache)
        for method in ("GET", "POST"):
            app.router.add_route(method, START_PROFILE_PATH, self.start_profile)
            app.router.add_route(method, STOP_PROFILE_PATH, self.stop_profile)
        app.router.add_get(PING_PATH, self.health)
        app.router.add_post(INVOCATIONS_PATH, self.invocations)
        app.router.add_get("/version", self.version)
        app.router.add_get(metrics.PATH, self.metrics_page)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.on_shutdown.append(self.background.finish)
        app.on_shutdown.append(self.batches.finish)
        app.on_cleanup.append(lambda _app: self.upstream.close())
        return app

    @web.middleware
    async def _counted(self, request: web.Request, handler):
        """Every request counted (metrics.py) with the status it was answered with, or DISCONNECTED."""
        call = self.metrics.begin(request.method, metrics.endpoint_of(request.match_info.route.resource))
        code: int | str = 500  # what aiohttp answers an exception that reaches it with
        try:
            answer = await handler(request)
            code = answer.status
            return answer
        except web.HTTPException as exc:
            code = exc.status
            raise
        except asyncio.CancelledError:  # the client went away (aiohttp's handler_cancellation)
            code = metrics.DISCONNECTED
            raise
        except ConnectionResetError:
            # It went away while its stream was written, before aiohttp cancelled the handler: a disconnection,
            # not a 500. Its prepared stream goes back to aiohttp, which ends an answer to a closed connection
            # quietly; raised on, it logged a traceback as "Error handling request" and counted a 500.
            prepared = request.get(_PREPARED)
            if prepared is None or (request.transport is not None and not request.transport.is_closing()):
                raise  # not the client's leaving: a 500 as before
            code = metrics.DISCONNECTED
            return prepared
        finally:
            self.metrics.end(call, code)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        if self.api_key and (request.path.startswith(API_PREFIX) or request.path in TOKENIZER_PATHS
                             or request.path in sglang_native.KEYED_PATHS or request.path in KEYED_PATHS):
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key
            given = request.headers.get("Authorization", "").encode()
            anthropic = request.headers.get("x-api-key", "").encode()
            key = self.api_key.encode()
            if not (hmac.compare_digest(given, b"Bearer " + key) or hmac.compare_digest(anthropic, key)):
                return error_response(ApiError(401, "Incorrect API key provided (Authorization: Bearer <key>, or "
                                                    "x-api-key: <key>)", code="invalid_api_key"), request.path)
        try:
            return await handler(request)
        except ApiError as exc:
            if request.get(_PREPARED) is not None:  # its stream began (kept alive while waiting): an event
                return await self._error_event(request[_PREPARED], exc, request.path)
            return error_response(exc, request.path)
        except web.HTTPRequestEntityTooLarge:
            return error_response(ApiError(413, f"the request body is over the API's limit of {MAX_BODY_MIB} MiB: "
                                                f"{request.method} {request.path}"), request.path)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}"),
                                      request.path)
            raise

    async def _error_event(self, response: web.StreamResponse, error: ApiError, path: str) -> web.StreamResponse:
        """An error that came after a stream's headers, before its answer began: the stream's error event, in
        the form of the API it is (as each API's stream sends one after its answer began)."""
        self.metrics.stream_error(error.status)
        if path.startswith(MESSAGES_PREFIX):
            data = messages.event("error", error=messages.error_body(error)["error"])
        elif path.startswith(RESPONSES_PREFIX):
            data = responses.sse(responses.event("error", 0, code=error.code, message=error.message, param=error.param))
        else:
            data = protocol.sse(error.body()) + protocol.sse("[DONE]")
        await response.write(data)
        await response.write_eof()
        return response

    async def _waited(self, request: web.Request | None, awaitable):
        """`awaitable`'s result. A streamed answer (`request` given) can be silent long before its first token
        (the server full: a generation slot, KV room) or a background response's next event: past keepalive_s
        its SSE headers go out and a comment line each keepalive_s after, so that proxies and clients that
        close idle connections (often after 60 s) keep it. An error after the headers is the stream's error
        event (`_error_event`), not an HTTP status."""
        if request is None or self.keepalive_s <= 0:
            return await awaitable
        task = asyncio.ensure_future(awaitable)
        try:
            while not (await asyncio.wait({task}, timeout=self.keepalive_s))[0]:
                await (await _event_stream(request)).write(KEEPALIVE)
            return task.result()
        finally:
            if not task.done():  # the client went away
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _body(self, request: web.Request) -> dict:
        try:
            return await request.json(loads=json_text.parse)
        except ValueError as exc:  # undecodable bytes included
            raise ApiError(400, f"the request body is not JSON ({exc})") from None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        gen = self._identified(request, body, self._parse_chat(body))
        try:
            return await self._answer(request, gen)
        except ApiError as exc:
            raise protocol.chat_error(exc) from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._answer(request, self._identified(request, body, self._completion(body)))

    @staticmethod
    def _identified(request: web.Request, body, gen: Generation) -> Generation:
        """The generation under the id its client gave (protocol.request_id), which the answer's
        X-Request-Id header repeats (_request_id_header)."""
        given = protocol.request_id(request.headers.get(protocol.REQUEST_ID_HEADER),
                                    body if isinstance(body, dict) else {})
        if given is not None:
            gen.id = given
        request[_REQUEST_ID] = gen.id
        return gen

    def _completion(self, body) -> Generation:
        gen = protocol.parse_completion(body, self.served, self.sampling_defaults)
        if gen.echo and self.tokenizer is None and any(not isinstance(prompt, str) for prompt in gen.echo):
            raise protocol.invalid("echo", "of a prompt of token ids needs the API's tokenizer (--tokenizer)")
        return gen

    # ---- the Batch API (batches.py) ------------------------------------------------------------------------
    async def create_file(self, request: web.Request) -> web.Response:
        """POST /v1/files: multipart/form-data with `file` (JSON lines) and `purpose` (`batch`)."""
        if not request.content_type.startswith("multipart/"):
            raise protocol.invalid("file", "must be sent as multipart/form-data, with purpose")
        content, filename, purpose, expires_after = None, "file", None, {}
        async for part in await request.multipart():
            if part.name == "file":
                filename, data = part.filename or filename, bytearray()
                while chunk := await part.read_chunk():
                    data += chunk
                    if len(data) > batches.MAX_FILE_BYTES:
                        raise ApiError(413, f"file: larger than {batches.MAX_FILE_BYTES >> 20} MiB", "file")
                content = bytes(data)
            elif part.name == "purpose":
                purpose = await part.text()
            elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):  # the SDKs' form of the object
                expires_after[part.name[14:-1]] = await part.text()
        if content is None:
            raise protocol.invalid("file", "is required")
        if purpose is None:
            raise protocol.invalid("purpose", "is required")
        seconds = batches.expiry(expires_after or None, "expires_after")
        return web.json_response(await self.files.create(content, filename, purpose, seconds))

    async def list_files(self, request: web.Request) -> web.Response:
        return web.json_response(_page(await self.files.all(request.query.get("purpose")), request.query, "a file"))

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(await self.files.get(request.match_info["id"]))

    async def file_content(self, request: web.Request) -> web.Response:
        return web.Response(text=await self.files.content(request.match_info["id"]), content_type="application/jsonl")

    async def delete_file(self, request: web.Request) -> web.Response:
        return web.json_response(await self.files.delete(request.match_info["id"]))

    async def create_batch(self, request: web.Request) -> web.Response:
        return web.json_response(await self.batches.create(await self._body(request)))

    async def list_batches(self, request: web.Request) -> web.Response:
        return web.json_response(_page(await self.batches.all(), request.query, "a batch"))

    async def get_batch(self, request: web.Request) -> web.Response:
        return web.json_response(await self.batches.get(request.match_info["id"]))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        return web.json_response(await self.batches.cancel(request.match_info["id"]))

    async def _batch_answer(self, url: str, body: dict) -> tuple[int, dict]:
        """One request of a batch answered whole, as its endpoint answers it: (HTTP status, JSON body); counted
        in the API's metrics as a request to that endpoint."""
        call = self.metrics.begin("POST", url)
        status = 500
        try:
            if url == "/v1/chat/completions":
                try:
                    answer = await self._whole_answer(self._parse_chat(body))
                except ApiError as exc:
                    raise protocol.chat_error(exc) from None
            elif url == "/v1/responses":
                answer = await self._response_answer(body)
            else:
                answer = await self._whole_answer(self._completion(body))
            status = 200
            return status, answer
        except ApiError as exc:
            status = exc.status
            return status, exc.body()
        finally:
            self.metrics.end(call, status)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API: the chat request it stands for, answered as a `response` (responses.py); kept
        (`store`, the default, where the gateway keeps responses) for previous_response_id to continue."""
        body = responses.checked(await self._body(request))
        if body.get("background") and not self.store.enabled:
            raise protocol.invalid("background", "needs stored responses, and this server keeps none (its "
                                                 "--responses-store-mb is 0)")
        history, keep = await self._response_context(body)
        try:
            gen = await self._response_chat(body, history)
            if body.get("background"):
                started = await self.background.start(gen, body)
                if gen.stream:  # its events as they are stored; a client that leaves stops nothing
                    return await self._follow(request, started["id"], -1)
                return web.json_response(started)
            async with self._pieces(gen, request) as pieces:  # errors before the first token: HTTP errors
                if gen.stream:
                    return await self._stream_response(request, gen, body, pieces, keep)
                answer = await self._whole_response(gen, body, pieces, keep)
            await self._keep(keep, answer, body)
            return web.json_response(answer)
        except ApiError as exc:
            raise responses.renamed(protocol.chat_error(exc)) from None

    async def _response_context(self, body: dict) -> tuple[list[dict], bool]:
        """A Responses request's history (the stored response it continues, or its conversation's items) and
        whether its answer is kept."""
        previous = body.get("previous_response_id")
        history = await self._conversation(previous) if previous is not None else []
        conversation = conversations.conversation_id(body.get("conversation"))
        if conversation is not None:
            history = await self._conversation_history(conversation)
        return history, self.store.enabled and body.get("store") is not False

    async def _response_answer(self, body) -> dict:
        """A Responses request answered whole, and kept as the endpoint keeps it (a batch's: not streamed, not
        in the background)."""
        body = responses.checked(body)
        if body.get("background"):
            raise protocol.invalid("background", "is not for a batch's request (the batch runs in the background)")
        history, keep = await self._response_context(body)
        try:
            gen = await self._response_chat(body, history)
            async with self._pieces(gen) as pieces:
                answer = await self._whole_response(gen, body, pieces, keep)
        except ApiError as exc:
            raise responses.renamed(protocol.chat_error(exc)) from None
        await self._keep(keep, answer, body)
        return answer

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages: Anthropic's Messages API, the chat request it stands for (messages.py) answered as
        a `message`, or streamed as its events."""
        body = await self._body(request)
        try:
            # (a thinking budget where the server knows where the thinking ends)
            gen = self._parse_chat(messages.chat_body(body, budgets=self.reasoning_parser is not None))
            async with self._pieces(gen, request) as pieces:  # errors before the first token: HTTP errors
                if gen.stream:
                    return await self._stream_message(request, gen, body, pieces)
                merged = Piece()
                async for _, piece in pieces:
                    merged.add(piece)
        except ApiError as exc:
            raise messages.renamed(protocol.chat_error(exc)) from None
        thinking, text = reasoning.split(merged.text, gen.reasoning) if gen.reasoning else (None, merged.text)
        text, reason, calls = self._answer_calls(gen, text or "", self._finish_reason(merged))
        stop = self._stop_sequence(body, merged, reason, bool(calls))
        content = messages.content_blocks(text, calls, thinking if gen.include_reasoning else None)
        return web.json_response(messages.message_object(
            gen, content, messages.stop_reason(reason, bool(calls), stop), stop, self._message_usage(merged),
            protocol.combined_stats([merged.stats])))

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the prompt's tokens, as the server renders the request."""
        tokenizer = self._tokenizer()
        gen = self._parse_chat(messages.chat_body(await self._body(request), count=True))
        try:
            count = await asyncio.to_thread(tokenization.chat_prompt_length, tokenizer, gen.choices[0],
                                          self.content_format)
        except ValueError as exc:
            raise protocol.invalid("messages", str(exc)) from None
        return web.json_response({"input_tokens": count})

    def _stop_sequence(self, body: dict, merged: Piece, reason: str | None, called: bool) -> str | None:
        """The stop sequence that ended an answer (read from its tokens: the text sent stops before it); None
        when none did, or without the tokenizer to tell."""
        if reason != "stop" or called or not body.get("stop_sequences") or self.tokenizer is None:
            return None
        generated = self.tokenizer.decode(merged.ids, skip_special_tokens=True)
        return messages.matched_stop(generated, merged.text, body["stop_sequences"])

    @staticmethod
    def _message_usage(merged: Piece, started: bool = False) -> dict:
        """An answer's usage in Anthropic's form (`started`: message_start's, before any output)."""
        prompt, completion, cached = protocol.token_counts(merged.stats, len(merged.ids))
        return messages.usage(prompt, 0 if started else completion, cached)

    async def _stream_message(self, request: web.Request, gen: Generation, body: dict, pieces) -> web.StreamResponse:
        """The Messages API's events: message_start, then each content block (a reasoning model's thinking, the
        text, each tool call) as its start, its deltas as the server accepts tokens and its stop; message_delta
        (stop_reason, usage) and message_stop. Tool calls stream as the chat's do (tools.ToolStream)."""
        response = await _event_stream(request)
        merged, block = Piece(), {"index": -1, "type": None}
        thinker = reasoning.ReasoningStream(gen.reasoning) if gen.reasoning else None
        calls = tools.ToolStream(gen.tools) if gen.tools is not None else None
        called = False

        async def send(kind: str, **fields) -> None:
            await response.write(messages.event(kind, **fields))

        async def close() -> None:
            if block["type"] is not None:
                await send("content_block_stop", index=block["index"])
                block["type"] = None

        async def open_block(start: dict) -> None:
            """A new content block (the open one closed first)."""
            await close()
            block["index"] += 1
            block["type"] = start["type"]
            await send("content_block_start", index=block["index"], content_block=start)

        async def delta(kind: str, start: dict, **fields) -> None:
            """A delta of the open block of this kind (a new block started first where another is open)."""
            if block["type"] != start["type"]:
                await open_block(start)
            await send("content_block_delta", index=block["index"], delta={"type": kind, **fields})

        async def emit(text: str, thinking: str, deltas: list[dict] | None = None) -> None:
            if thinking and gen.include_reasoning:
                await delta("thinking_delta", {"type": "thinking", "thinking": "", "signature": ""}, thinking=thinking)
            if deltas is None:
                text, deltas = calls.feed(text) if calls is not None else (text, [])
            if text:
                await delta("text_delta", {"type": "text", "text": ""}, text=text)
            for call in deltas:
                if "id" in call:  # a call's first delta: its block opens
                    await open_block({"type": "tool_use", "id": messages.TOOL_USE_PREFIX + call["id"].removeprefix(
                        "call_"), "name": call["function"]["name"], "input": {}})
                if call["function"].get("arguments"):
                    await send("content_block_delta", index=block["index"],
                               delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
        async def start() -> None:
            await send("message_start", message=messages.message_object(gen, [], None, None,
                                                                        self._message_usage(merged, started=True)))
        try:
            started = False
            async for _, piece in pieces:
                merged.add(piece)
                if not started:  # with the first response: the prompt's count comes with it
                    await start()
                    started = True
                thinking, text = thinker.feed(piece.text) if thinker is not None else ("", piece.text)
                await emit(text, thinking)
            if not started:
                await start()
            if thinker is not None:  # what it held back: the end of a possible tag
                thinking, text = thinker.finish()
                await emit(text, thinking)
            if calls is not None:
                rest, deltas, called = calls.finish()
                await emit(rest, "", deltas)
            await close()
            reason = self._finish_reason(merged)
            stop = self._stop_sequence(body, merged, reason, called)
            await send("message_delta", delta={"stop_reason": messages.stop_reason(reason, called, stop),
                                               "stop_sequence": stop}, usage=self._message_usage(merged),
                       **{STATS_FIELD: protocol.combined_stats([merged.stats])})
            await send("message_stop")
        except ApiError as exc:  # after the stream began: an error event, as Anthropic's SDK reads one
            self.metrics.stream_error(exc.status)
            await send("error", error=messages.error_body(messages.renamed(exc))["error"])
        await response.write_eof()
        return response

    @contextlib.asynccontextmanager
    async def _pieces(self, gen: Generation, request: web.Request | None = None):
        """A Responses or Messages request's one choice as (index, piece) pairs, its first awaited before they
        are handed over (an error before the first token raises here; a streamed one's `request` kept alive
        meanwhile: `_waited`); the upstream stream closed on leaving."""
        async with contextlib.AsyncExitStack() as stack:
            stream = await stack.enter_async_context(contextlib.aclosing(self.metrics.counted(
                self.upstream.generate(gen.choices[0], gen.logprobs, gen.top_logprobs > 0),
                lora=_lora_name(gen.choices[0]))))
            firsts = await self._waited(request if gen.stream else None, _guide_named(gen, _first_pieces([stream])))
            yield await stack.enter_async_context(contextlib.aclosing(_merged([stream], firsts)))

    async def _background_answer(self, gen: Generation, body: dict, started: dict, send) -> dict:
        """A background response generated, its stream's events (after created and in_progress) sent to its
        log: its answer (the end's event is the caller's, once the answer is stored)."""
        async with self._pieces(gen) as pieces:
            return await self._response_events(gen, body, pieces, send, started)

    async def _follow(self, request: web.Request, response_id: str, after: int) -> web.StreamResponse:
        """A background response's stream from its log: its events after sequence number `after`, then those
        that come, until its end."""
        response = await _event_stream(request)
        async with contextlib.aclosing(self.background.follow(response_id, after)) as events:
            while (event := await self._waited(request, anext(events, None))) is not None:
                await response.write(responses.sse(event))
        await response.write_eof()
        return response

    async def _whole_response(self, gen: Generation, body: dict, pieces, stored: bool) -> dict:
        """A response's answer, its pieces gathered (not streamed)."""
        merged = Piece()
        async for _, piece in pieces:
            merged.add(piece)
        thinking, text = reasoning.split(merged.text, gen.reasoning) if gen.reasoning else (None, merged.text)
        text, reason, calls = self._answer_calls(gen, text or "", self._finish_reason(merged))
        thinking = thinking if gen.include_reasoning else None
        logprobs = self._logprobs(gen, merged, 0)
        return responses.response_object(
            gen, body, responses.status_of(reason),
            responses.output_items(text, calls, thinking, logprobs and logprobs["content"]),
            self._response_usage(gen, merged), protocol.combined_stats([merged.stats]), stored)

    async def _response_chat(self, body: dict, history: list[dict]) -> Generation:
        """The chat request a Responses request stands for; with `truncation: auto`, its conversation's oldest
        turns dropped, as few as make it fit the context with its max_output_tokens (where this API has the
        tokenizer and knows the context: otherwise the server refuses what does not fit, as without it)."""
        def chat(dropped: int) -> Generation:
            return self._parse_chat(responses.chat_body(body, history, dropped))

        gen = chat(0)
        if not responses.truncating(body) or self.tokenizer is None or not self.max_model_len:
            return gen
        cuts = responses.turn_cuts(history + responses.input_messages(body))
        # off the event loop: a long conversation's template takes milliseconds per rendering, a few renderings
        return await asyncio.to_thread(self._fitted, gen, chat, cuts)

    def _fitted(self, gen: Generation, chat: Callable[[int], Generation], cuts: list[int]) -> Generation:
        """The first of the cuts (fewest messages dropped) whose request fits the context (ApiError naming
        input when not even the last turn does): a binary search, as fewer dropped never takes fewer tokens."""
        def overflow(candidate: Generation) -> tuple[int, int]:
            inputs = candidate.choices[0]
            try:
                length = tokenization.chat_prompt_length(self.tokenizer, inputs, self.content_format)
            except ValueError:  # refused by the template: the server says so, naming the field
                return 0, 0
            return length, length + tokenization.requested_max_tokens(inputs, self.default_max_tokens) \
                - self.max_model_len

        if overflow(gen)[1] <= 0:
            return gen
        low, high, best = 1, len(cuts) - 1, None
        while low <= high:  # the smallest index whose cut fits
            middle = (low + high) // 2
            candidate = chat(cuts[middle])
            if overflow(candidate)[1] <= 0:
                best, high = candidate, middle - 1
            else:
                low = middle + 1
        if best is None:
            last = chat(cuts[-1])
            length, _ = overflow(last)
            max_tokens = tokenization.requested_max_tokens(last.choices[0], self.default_max_tokens)
            raise protocol.invalid("input", f"its last turn takes {length} tokens (with instructions and tools); "
                                            f"with {max_tokens} output tokens that is over the model's context of "
                                            f"{self.max_model_len} (truncation: auto drops earlier turns only)")
        return best

    async def _conversation(self, previous: str) -> list[dict]:
        """The stored conversation a request continues (ApiError naming previous_response_id)."""
        if not self.store.enabled:
            raise protocol.invalid("previous_response_id", "responses are not stored by this server (its "
                                   "--responses-store-mb is 0): send the whole conversation in input")
        try:
            status = (await self.background.current(await in_store(self.store, self.store.get, previous)))["status"]
            if status in responses.PENDING:  # a background response not done yet: no answer to continue from
                raise protocol.invalid("previous_response_id", f"response {previous!r} is still {status} (a "
                                       "background response): continue it once it is done")
            return await in_store(self.store, self.store.conversation, previous)
        except NotStored as exc:
            what = "" if exc.missing == previous else f": an earlier response of its conversation ({exc.missing})"
            raise protocol.invalid("previous_response_id", f"response {previous!r} is not stored here{what} (never "
                                   "stored, deleted, or let go to keep within the server's store)") from None

    async def _keep(self, keep: bool, answer: dict, body: dict) -> None:
        """An answered response stored (`keep`), and added to its conversation (one it continues)."""
        if keep:
            messages = responses.input_messages(body) + responses.output_messages(answer["output"])
            await in_store(self.store, self.store.put, answer, messages, body.get("previous_response_id"),
                           responses.input_items(body))
        await self._add_to_conversation(answer, body)

    async def _add_to_conversation(self, answer: dict, body: dict) -> None:
        """A response's input and output items added to the conversation it continues (none: nothing)."""
        conversation = conversations.conversation_id(body.get("conversation"))
        if conversation is not None:
            with contextlib.suppress(NotStored):  # deleted meanwhile
                await self.conversations.add(conversation, conversations.answer_items(body, answer))

    async def _conversation_history(self, conversation: str) -> list[dict]:
        """A conversation's items as the chat's messages (ApiError naming conversation when it is not held)."""
        try:
            return conversations.history(await self.conversations.items(conversation))
        except NotStored:
            raise protocol.invalid("conversation", f"conversation {conversation!r} is not stored here (never "
                                                   "created, deleted, or let go to keep within the server's store)") \
                from None

    # ---- the Conversations API ----------------------------------------------------------------------------
    async def _held_conversation(self, request: web.Request) -> tuple[str, dict]:
        """(the id asked for, the conversation); 404 when it is not held."""
        conversation_id = request.match_info["id"]
        try:
            return conversation_id, await self.conversations.get(conversation_id)
        except NotStored:
            raise ApiError(404, f"No conversation found with id {conversation_id!r}", "id", "not_found") from None

    async def create_conversation(self, request: web.Request) -> web.Response:
        """POST /v1/conversations: a conversation, with its first items (up to 20) and metadata."""
        body = await self._body(request)
        if not isinstance(body, dict) or set(body) - {"items", "metadata"}:
            raise protocol.invalid(sorted(set(body) - {"items", "metadata"})[0] if isinstance(body, dict) else "body",
                                   "unrecognized request argument (items and metadata are)")
        if not self.conversations.enabled:
            raise protocol.invalid("items", "this server keeps no conversations (its --responses-store-mb is 0)")
        items = conversations.checked_items(body.get("items"))
        return web.json_response(await self.conversations.create(items, conversations.checked_metadata(
            body.get("metadata"))))

    async def get_conversation(self, request: web.Request) -> web.Response:
        return web.json_response((await self._held_conversation(request))[1])

    async def update_conversation(self, request: web.Request) -> web.Response:
        """POST /v1/conversations/{id}: its metadata replaced."""
        conversation_id, _ = await self._held_conversation(request)
        body = await self._body(request)
        if not isinstance(body, dict) or "metadata" not in body:
            raise protocol.invalid("metadata", "is required")
        try:
            return web.json_response(await self.conversations.update(
                conversation_id, conversations.checked_metadata(body["metadata"])))
        except NotStored:
            raise ApiError(404, f"No conversation found with id {conversation_id!r}", "id", "not_found") from None

    async def delete_conversation(self, request: web.Request) -> web.Response:
        conversation_id, _ = await self._held_conversation(request)
        await self.conversations.delete(conversation_id)
        return web.json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_conversation_items(self, request: web.Request) -> web.Response:
        """GET /v1/conversations/{id}/items: its items, paged as OpenAI pages them."""
        conversation_id, _ = await self._held_conversation(request)
        return web.json_response(_page(await self.conversations.items(conversation_id), request.query,
                                       "an item of this conversation"))

    async def add_conversation_items(self, request: web.Request) -> web.Response:
        """POST /v1/conversations/{id}/items: items appended (up to 20), listed back with their ids."""
        conversation_id, _ = await self._held_conversation(request)
        body = await self._body(request)
        given = body.get("items") if isinstance(body, dict) else None
        if not given:
            raise protocol.invalid("items", "is required: a non-empty list of items")
        try:
            added = await self.conversations.add(conversation_id, conversations.checked_items(given))
        except NotStored:
            raise ApiError(404, f"No conversation found with id {conversation_id!r}", "id", "not_found") from None
        return web.json_response({"object": "list", "data": added, "first_id": added[0]["id"],
                                  "last_id": added[-1]["id"], "has_more": False})

    async def get_conversation_item(self, request: web.Request) -> web.Response:
        conversation_id, _ = await self._held_conversation(request)
        item_id = request.match_info["item"]
        for item in await self.conversations.items(conversation_id):
            if item.get("id") == item_id:
                return web.json_response(item)
        raise ApiError(404, f"No item found with id {item_id!r} in conversation {conversation_id!r}", "item_id",
                       "not_found")

    async def delete_conversation_item(self, request: web.Request) -> web.Response:
        """DELETE /v1/conversations/{id}/items/{item}: the item removed; the conversation."""
        conversation_id, _ = await self._held_conversation(request)
        item_id = request.match_info["item"]
        try:
            return web.json_response(await self.conversations.remove(conversation_id, item_id))
        except NotStored:
            raise ApiError(404, f"No item found with id {item_id!r} in conversation {conversation_id!r}", "item_id",
                           "not_found") from None

    async def _stored(self, request: web.Request, call: Callable):
        """(the id asked for, the store's answer for it); 404 when it is not held."""
        response_id = request.match_info["id"]
        try:
            return response_id, await in_store(self.store, call, response_id)
        except NotStored:
            raise ApiError(404, f"No response found with id {response_id!r} (never stored, deleted, or let go to "
                                "keep within the server's store)", "id", "not_found") from None

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/responses/{id}: a stored response as it was answered (404 when not held); with
        `stream=true`, a background response's stream (`starting_after`: the events after that sequence
        number; all of them without), replayed from its log and followed to its end."""
        response_id, response = await self._stored(request, self.store.get)
        response = await self.background.current(response)
        stream = request.query.get("stream", "false")
        if stream not in ("true", "false"):
            raise protocol.invalid("stream", "must be true or false")
        if stream == "false":
            return web.json_response(response)
        if not response.get("background"):
            raise protocol.invalid("stream", f"response {response_id!r} was not created with background: true: "
                                             "only those are streamed again")
        try:
            after = int(request.query.get("starting_after", "-1"))
        except ValueError:
            after = -2
        if after < -1:
            raise protocol.invalid("starting_after", "must be an event's sequence number (an integer from 0)")
        return await self._follow(request, response_id, after)

    async def stored_input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: a stored response's request's input items, as OpenAI pages them
        (`limit` 1-100, default 20; `order` desc (the default) or asc; `after` an item's id)."""
        _, items = await self._stored(request, self.store.input_items)
        return web.json_response(_page(items, request.query, "an input item of this response"))

    async def cancel_response(self, request: web.Request) -> web.Response:
        """POST /v1/responses/{id}/cancel: stop a background response (404 when not held; 400 for one not
        made in the background). One already ended comes back as it is; one in flight on another replica
        (a shared store) stops there within background.WATCH_S."""
        response_id, response = await self._stored(request, self.store.get)
        if not response.get("background"):
            raise ApiError(400, f"response {response_id!r} was not created with background: true: only those can "
                                "be cancelled", "id")
        response = await self.background.current(response)
        return web.json_response(await self.background.cancel(response))

    async def delete_response(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{id}: forget a stored response (404 when not held). A response that continued
        it can no longer be continued, as its conversation is incomplete."""
        def delete(response_id: str) -> None:
            if not self.store.delete(response_id):
                raise NotStored(response_id)

        response_id, _ = await self._stored(request, delete)
        self.background.stop(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    @staticmethod
    def _answer_calls(gen: Generation, text: str, reason: str | None) -> tuple[str | None, str | None, list[dict]]:
        """A whole answer's (content, OpenAI's finish reason, tool calls)."""
        if gen.tools is None:
            return text, reason, []
        content, found = tools.split_output(text, gen.tools)
        return content, (gen.tools.finish_reason(reason) if found else reason), found

    def _response_usage(self, gen: Generation, merged: Piece) -> dict:
        prompt, completion, cached = protocol.token_counts(merged.stats, len(merged.ids))
        return responses.usage(prompt, completion, self._reasoning_tokens(gen, merged.ids) or 0, cached)

    def _reasoning_tokens(self, gen: Generation, ids: list[int]) -> int | None:
        """How many of a choice's tokens are its thinking (with a reasoning parser and the tokenizer: None
        without, and no count is reported)."""
        if gen.reasoning is None or self.tokenizer is None:
            return None
        skip = gen.sampling.get("skip_special_tokens", True)  # as the server decoded them (gpt-oss's markers kept)
        return reasoning.thinking_tokens(ids, lambda part: self.tokenizer.decode(part, skip_special_tokens=skip),
                                         gen.reasoning)

    async def _stream_response(self, request: web.Request, gen: Generation, body: dict, pieces,
                               keep: bool) -> web.StreamResponse:
        """The Responses API's events: created, in_progress, the message's item and text part added, its
        text deltas as the server accepts tokens, their done events, completed (or incomplete). A reasoning
        model's thinking (with a reasoning parser) first, as a reasoning item of its own. With tools,
        content streams as the chat's does (tools.ToolStream: until a call opens), a named function's
        arguments as they are generated, and calls the model wrote in its own format at the end, each
        as its item's added, arguments delta and done events."""
        response = await _event_stream(request)
        number = iter(range(1 << 62))

        async def send(kind: str, **fields) -> None:
            await response.write(responses.sse(responses.event(kind, next(number), **fields)))

        started = responses.response_object(gen, body, "in_progress", [], stored=keep)
        await send("response.created", response=started)
        await send("response.in_progress", response=started)
        try:
            answer = await self._response_events(gen, body, pieces, send, started)
            await self._keep(keep, answer, body)  # before its end's event: a client may continue it at once
            await send(responses.ending_event(answer), response=answer)
        except ApiError as exc:  # after the stream began: an error event
            self.metrics.stream_error(exc.status)
            error = responses.renamed(exc)
            await send("error", code=error.code, message=error.message, param=error.param)
        await response.write_eof()
        return response

    async def _response_events(self, gen: Generation, body: dict, pieces, send, started: dict) -> dict:
        """A response's events after created and in_progress, up to its end's (the caller's, once it has
        stored the answer): its answer."""
        message = _StreamedItem("message", "msg_" + gen.id, send)
        thought = _StreamedItem("reasoning", "rs_" + gen.id, send)
        thinker = reasoning.ReasoningStream(gen.reasoning) if gen.reasoning else None
        calls = tools.ToolStream(gen.tools) if gen.tools is not None else None
        streamed = None  # a named function's call, its arguments streamed as they come: (item, index)
        merged, output = Piece(), []

        async def call_deltas(deltas: list[dict]) -> None:
            nonlocal streamed
            for delta in deltas:
                if "id" in delta:  # a call's first delta: its item opens
                    item = responses.function_call_item(delta["function"])
                    item["call_id"], item["arguments"], item["status"] = delta["id"], "", "in_progress"
                    streamed = (item, len(output) + (message.opened and not message.closed))
                    await send("response.output_item.added", output_index=streamed[1], item=dict(item))
                item, index = streamed
                item["arguments"] += delta["function"]["arguments"]
                if delta["function"]["arguments"]:
                    await send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=delta["function"]["arguments"])
        async def answer(text: str, thinking: str) -> list[dict]:
            """A round's text (or the end's) as its items' deltas: the thinking's, then the answer's."""
            if thinking and gen.include_reasoning:
                await thought.add(thinking, len(output))
            if text and thought.opened and not thought.closed:  # the answer began: the thinking is done
                output.append(await thought.done())
            content, deltas = calls.feed(text) if calls is not None else (text, [])
            await message.add(content, len(output))
            return deltas

        async for _, piece in pieces:
            merged.add(piece)
            if gen.logprobs:  # a round's tokens', sent with the message's next text delta
                message.logprobs += self._logprobs(gen, piece, 0)["content"]
            thinking, text = thinker.feed(piece.text) if thinker is not None else ("", piece.text)
            await call_deltas(await answer(text, thinking))
        if thinker is not None:  # what it held back: the end of a possible tag
            thinking, text = thinker.finish()
            await call_deltas(await answer(text, thinking))
        if thought.opened and not thought.closed:
            output.append(await thought.done())
        deltas, called, reason = [], False, self._finish_reason(merged)
        if calls is not None:
            content, deltas, called = calls.finish()
            await message.add(content, len(output))
            if called:
                reason = gen.tools.finish_reason(reason)
        if message.opened or not called:  # the message item comes first, and is done before any call
            output.append(await message.done(len(output)))
        if streamed is None:  # whole calls at the end, each opened and done in turn
            for delta in deltas:
                await call_deltas([delta])
                await self._call_done(send, streamed, output)
                streamed = None
        else:  # the named function's call: its last arguments
            await call_deltas(deltas)
            await self._call_done(send, streamed, output)
        return responses.response_object(gen, body, responses.status_of(reason), output,
                                         self._response_usage(gen, merged), protocol.combined_stats([merged.stats]),
                                         started["store"])

    @staticmethod
    async def _call_done(send, streamed: tuple[dict, int], output: list[dict]) -> None:
        item, index = streamed
        item["status"] = "completed"
        await send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                   arguments=item["arguments"], name=item["name"])
        output.append(item)
        await send("response.output_item.done", output_index=index, item=item)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: OpenAI's list; to Anthropic's clients (their `anthropic-version` header) also the
        fields of Anthropic's (each model's type, display_name and created_at; the page's ids)."""
        anthropic = messages.ANTHROPIC_VERSION_HEADER in request.headers
        names = self.served.listed()
        cards = [self._model_card(name, anthropic) for name in names]
        page = {"object": "list", "data": cards}
        if anthropic:
            page.update(has_more=False, first_id=names[0], last_id=names[-1])
        return web.json_response(page)

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.served:
            raise ApiError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
        return web.json_response(self._model_card(name, messages.ANTHROPIC_VERSION_HEADER in request.headers))

    def _model_card(self, name: str, anthropic: bool = False) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "specdec"}
        if protocol.is_adapter(self.served, name):  # a LoRA adapter's model: its base is its parent (vLLM's)
            card.update(root=name, parent=self.served[0])
        if self.max_model_len:  # as vLLM's cards say it
            card["max_model_len"] = self.max_model_len
        if anthropic:
            card.update(messages.model_card(name, self.created))
        return card

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}: the adapter served as a model of its
        name once the target has read it (one token generated with it: an adapter that does not fit the target
        is refused here, naming its path, not at its first request)."""
        runtime = self.runtime_adapters
        load = runtime.load_request(await self._body(request))
        before = await asyncio.to_thread(runtime.link, load)
        try:
            gen = protocol.parse_completion({"model": load.name, "prompt": "Hello", "max_tokens": 1}, self.served)
            async with contextlib.aclosing(self.upstream.generate(gen.choices[0], False)) as pieces:
                async for _ in pieces:
                    pass
        except BaseException as exc:
            await asyncio.shield(asyncio.to_thread(runtime.restore, load, before))
            if isinstance(exc, ApiError):
                raise ApiError(exc.status, f"LoRA adapter {load.name!r} ({load.path}) not loaded: {exc.message}",
                               param="lora_path", code=exc.code) from None
            raise
        self.log(f"LoRA adapter {load.name!r} loaded from {load.path}{' in place' if before else ''}")
        return web.Response(text=adapters.LOADED.format(load.name))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """POST /v1/unload_lora_adapter {lora_name}: no longer served (requests running it run on)."""
        runtime = self.runtime_adapters
        name = runtime.unload_request(await self._body(request))
        await asyncio.to_thread(runtime.unlink, name)
        self.log(f"LoRA adapter {name!r} unloaded")
        return web.Response(text=adapters.UNLOADED.format(name))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's GET or POST /flush_cache: the server's caches reset (its answer's text). Unlike SGLang's, it
        is done with requests running too: they keep the blocks they hold."""
        await self._reset_caches(request.path)
        return web.Response(text=sglang_native.FLUSHED)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache[?reset_running_requests=&reset_external=]: the server's caches reset,
        an empty 200. Both flags are read and change nothing: running requests keep the blocks they hold (no
        preemption is needed for the reset to take), and there is no external KV cache."""
        for name in RESET_FLAGS:
            value = request.query.get(name)
            if value is not None and value.lower() not in QUERY_BOOLEANS:
                raise ApiError(400, f"query parameter '{name}': {value!r} is not a boolean (true or false)",
                               param=name)
        await self._reset_caches(request.path)
        return web.Response()

    async def _reset_caches(self, path: str) -> None:
        """Ask every model instance to forget its cached prefixes and suffix index (cache_reset.py): every request
        that arrives after this returns finds them empty."""
        if not self.cache_reset_file:
            raise ApiError(501, "resetting the server's caches needs the marker file the launcher names "
                                f"(--cache-reset-file, ${cache_reset.ENV}); this API was started without one",
                           code="not_implemented")
        try:
            await asyncio.to_thread(cache_reset.request, self.cache_reset_file)
        except OSError as exc:
            raise ApiError(500, f"the caches were not reset: {exc}", code="internal_error") from None
        self.log(f"caches reset at a client's request ({path}): prefix caches of every model, suffix caches")

    async def start_profile(self, request: web.Request) -> web.Response:
        """vLLM's and SGLang's /start_profile: every model instance profiles its executions from its next one
        on (live_profile.py). SGLang's body is optional: output_dir, activities, start_step, num_steps,
        with_stack, record_shapes. A start while a profile runs ends that one (its traces are written)."""
        self._profiling()
        fields = await self._body(request) if (await request.read()).strip() else {}
        try:
            command = live_profile.start_command(fields, self.profile_dir, live_profile.new_profile_id())
        except live_profile.SettingError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None
        try:
            await asyncio.to_thread(os.makedirs, command.output_dir, exist_ok=True)
            await asyncio.to_thread(live_profile.send, self.profile_control_file, command)
        except OSError as exc:
            raise ApiError(500, f"the profile was not started: {exc}", code="internal_error") from None
        self.log(f"profile {command.profile_id} started at a client's request: traces into {command.output_dir}")
        return web.Response(text=PROFILE_STARTED)

    async def stop_profile(self, request: web.Request) -> web.Response:
        """vLLM's and SGLang's /stop_profile: the running profile ends in every model instance; answered once
        their traces are written (PROFILE_STOP_WAIT_S at most), naming them."""
        self._profiling()
        started = await asyncio.to_thread(live_profile.current, self.profile_control_file)
        if started is None or started.action != "start":
            raise ApiError(400, f"no profile is running (POST {START_PROFILE_PATH} first)")
        try:
            await asyncio.to_thread(live_profile.send, self.profile_control_file,
                                    replace(started, action="stop"))
        except OSError as exc:
            raise ApiError(500, f"the profile was not stopped: {exc}", code="internal_error") from None
        deadline = time.monotonic() + PROFILE_STOP_WAIT_S
        # Each instance ends its profile within live_profile.POLL_S (idle) or its current execute
        await asyncio.sleep(2 * live_profile.POLL_S)
        while (pending := await asyncio.to_thread(live_profile.unfinished, started)) and time.monotonic() < deadline:
            await asyncio.sleep(live_profile.POLL_S / 2)
        written = await asyncio.to_thread(live_profile.traces, started)
        self.log(f"profile {started.profile_id} stopped at a client's request: {len(written)} traces written")
        lines = [PROFILE_STOPPED, *(f"{path}\n" for path in written)]
        lines += [f"still being written: {name}\n" for name in pending]
        return web.Response(text="".join(lines))

    def _profiling(self) -> None:
        if not self.profile_control_file:
            raise ApiError(501, "profiling needs the launcher's --torch-profiler-dir (or "
                                f"${live_profile.DIR_ENV}); this server was started without one",
                           code="not_implemented")

    def _parse_chat(self, body: dict) -> Generation:
        """A chat body (the chat API's, or one the Messages and Responses APIs made) with this API's settings."""
        return protocol.parse_chat(body, self.served, self.tool_parser, self.reasoning_parser,
                                   trust_template=self.trust_templates, defaults=self.sampling_defaults)

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ApiError(404, "the tokenizer endpoints need the API's tokenizer (--tokenizer)", code="not_found")
        return self.tokenizer

    async def tokenize(self, request: web.Request) -> web.Response:
        tokenizer = self._tokenizer()
        return web.json_response(tokenization.tokenize(tokenizer, await self._body(request), self.max_model_len,
                                                       self.trust_templates, self.content_format))

    async def detokenize(self, request: web.Request) -> web.Response:
        tokenizer = self._tokenizer()
        return web.json_response(tokenization.detokenize(tokenizer, await self._body(request)))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response(tokenization.tokenizer_info(self._tokenizer(), self.max_model_len))

    async def metrics_page(self, request: web.Request) -> web.Response:
        """GET /metrics: the API's Prometheus metrics (no API key, as /health: a scraper has none), and the
        server's under vLLM's names (vllm_metrics.py) where it knows the server's metrics port."""
        page = await asyncio.to_thread(self.metrics.page)  # a shared store's directory is listed
        server = await self._server_metrics()
        if server:
            page += await asyncio.to_thread(vllm_metrics.page, server, self.served[0], self.lora_info())
        return web.Response(body=page, headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _server_metrics(self) -> str:
        """The server's Prometheus text ("" without its metrics port, or when it does not answer within a
        second)."""
        if not self.server_metrics_url:
            return ""
        try:
            async with ClientSession(timeout=ClientTimeout(total=1.0)) as session, \
                    session.get(f"http://{self.server_metrics_url}/metrics") as answer:
                return await answer.text() if answer.status == 200 else ""
        except (ClientError, asyncio.TimeoutError):
            return ""

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """POST /invocations (SageMaker's, as vLLM routes it): a body with `messages` answered as
        /v1/chat/completions, one with `prompt` as /v1/completions (aiohttp keeps the body read)."""
        body = await self._body(request)
        if isinstance(body, dict) and "messages" in body:
            return await self.chat(request)
        if isinstance(body, dict) and "prompt" in body:
            return await self.completions(request)
        raise protocol.invalid("messages", "an invocation is a chat (messages) or a completion (prompt)")

    def lora_info(self) -> tuple[list[str], int] | None:
        """The adapters its generations run now and the target's adapter slots (vLLM's lora_requests_info);
        None where the server serves no adapter."""
        if not self.served.adapters and not self.served.directory:
            return None
        return sorted(self.metrics.lora_running), self.max_loras

    async def version(self, request: web.Request) -> web.Response:
        """GET /version (vLLM's): this server's version."""
        return web.json_response({"version": VERSION})

    async def health(self, request: web.Request) -> web.Response:
        if await self.upstream.ready():
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"not ready: {', '.join(self.upstream.models)} at {self.upstream.url}\n")

    # ---- SGLang's native API (sglang_native.py) ------------------------------------------------------------
    async def sglang_generate(self, request: web.Request) -> web.StreamResponse:
        """POST /generate: SGLang's request, answered by the completions path in SGLang's form."""
        started = time.monotonic()
        body = await self._body(request)
        try:
            native, bodies = sglang_native.completion_bodies(body, self.served[0])
            gens = [self._completion(one) for one in bodies]
        except ApiError as exc:
            raise sglang_native.renamed(exc) from None
        gen = gens[0]
        for other in gens[1:]:  # prompts of their own sampling_params: one request's choices all the same
            gen.choices += other.choices
        named = {"request_id": native.rids[0]} if not native.batch and native.rids[0] is not None else {}
        gen = self._identified(request, named, gen)
        listed = native.batch or native.n > 1  # SGLang answers a list then
        try:
            async with self._choices(gen, request if gen.stream else None) as (_, pieces):
                merged = [Piece() for _ in gen.choices]
                if gen.stream:
                    return await self._native_stream(request, gen, native, pieces, merged, started, listed)
                async for index, piece in pieces:
                    merged[index].add(piece)
            outputs = [self._native_output(gen, native, i, m, started) for i, m in enumerate(merged)]
        except ApiError as exc:
            raise sglang_native.renamed(exc) from None
        return web.json_response(outputs if listed else outputs[0])

    async def _native_stream(self, request: web.Request, gen: Generation, native: sglang_native.Native, pieces,
                             merged: list[Piece], started: float, listed: bool) -> web.StreamResponse:
        """SGLang's stream: an event per response with the output so far (text, ids, meta_info; with
        --incremental-streaming-output what it adds), `index` with several outputs, then [DONE]; an error after
        the stream began is an event {"error": ...}."""
        response = await _event_stream(request)
        sent = [(0, 0)] * len(merged)  # per output: the characters and tokens sent (incremental streaming)
        try:
            async for index, piece in pieces:
                merged[index].add(piece)
                if not piece.ids and not piece.finish_reason:
                    continue
                out = self._native_output(gen, native, index, merged[index], started)
                if self.incremental_streaming:
                    whole, out = out, sglang_native.incremental(out, *sent[index])
                    sent[index] = (len(whole["text"]), len(whole["output_ids"]))
                if listed:
                    out["index"] = index
                await response.write(protocol.sse(out))
        except ApiError as exc:
            self.metrics.stream_error(exc.status)
            await response.write(protocol.sse(sglang_native.renamed(exc).body()))
        await response.write(protocol.sse("[DONE]"))
        await response.write_eof()
        return response

    def _native_output(self, gen: Generation, native: sglang_native.Native, index: int, merged: Piece,
                       started: float) -> dict:
        """Output `index` as SGLang writes it, from its responses so far (`merged`)."""
        reason = self._finish_reason(merged)
        prompt, completion, cached = protocol.token_counts(merged.stats, len(merged.ids))
        if native.score_only:  # the one token generated is not the answer's (max_new_tokens 0)
            merged = replace(merged, text="", ids=[], log_probs=[], top_ids=[], top_log_probs=[],
                             stats={} if reason else merged.stats)
            completion, reason = 0, "length" if reason else reason
        matched = None
        if reason == "stop":
            stops, stop_ids = native.stops[index // native.n], native.stop_ids[index // native.n]
            if stops and self.tokenizer is not None:
                generated = self.tokenizer.decode(merged.ids, skip_special_tokens=True)
                matched = messages.matched_stop(generated, merged.text, stops)
            if matched is None and merged.ids and merged.ids[-1] in stop_ids:
                matched = merged.ids[-1]
        meta = {"id": native.output_id(index, f"{gen.id}-{index}"),
                "finish_reason": sglang_native.finish_reason(reason, merged.ids, completion, matched),
                "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}
        if reason:
            meta["e2e_latency"] = time.monotonic() - started
            meta.update(sglang_native.spec_info(merged.stats, completion))
        if native.return_logprob:
            name = self.token_text if native.return_text_in_logprobs and self.token_text is not None else None
            k = native.top_logprobs_num
            meta["output_token_logprobs"] = sglang_native.token_logprobs(merged.log_probs, merged.ids, name)
            meta["output_top_logprobs"] = sglang_native.top_logprobs(merged.top_ids, merged.top_log_probs, k, name) \
                if k else [None] * len(merged.ids)
            if native.logprob_start_len >= 0:
                at = native.logprob_start_len
                meta["input_token_logprobs"] = sglang_native.token_logprobs(merged.prompt_log_probs[at:],
                                                                            merged.prompt_ids[at:], name)
                meta["input_top_logprobs"] = sglang_native.top_logprobs(
                    merged.prompt_top_ids[at:], merged.prompt_top_log_probs[at:], k, name) if k else \
                    [None] * len(merged.prompt_ids[at:])
        return {"text": merged.text, "output_ids": merged.ids, "meta_info": meta}

    async def sglang_server_info(self, request: web.Request) -> web.Response:
        """GET /get_server_info (and /server_info): what SGLang's benchmarks read of it, `internal_states`'
        avg_spec_accept_length and last_gen_throughput (the tokens per second since the previous call), from
        the server's metrics; null where the API does not know the server's metrics port."""
        length, throughput = None, 0.0
        server = await self._server_metrics()
        if server:
            length, generated = sglang_native.server_figures(server)
            now = time.monotonic()
            if self._generated_at is not None and now > self._generated_at[0]:
                throughput = max(generated - self._generated_at[1], 0.0) / (now - self._generated_at[0])
            self._generated_at = (now, generated)
        return web.json_response({"version": VERSION, "served_model_name": self.served[0],
                                  "context_length": self.max_model_len or None,
                                  "internal_states": [{"avg_spec_accept_length": length,
                                                       "last_gen_throughput": throughput}]})

    async def sglang_model_info(self, request: web.Request) -> web.Response:
        """GET /get_model_info (and /model_info): the served model as SGLang describes its own."""
        return web.json_response({"model_path": self.served[0],
                                  "tokenizer_path": getattr(self.tokenizer, "name_or_path", None),
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": "default", "has_image_understanding": False,
                                  "has_audio_understanding": False})

    async def health_generate(self, request: web.Request) -> web.Response:
        """GET /health_generate (SGLang's): 200 once a one-token generation went through the whole path within
        HEALTH_GENERATE_TIMEOUT_S, else 503 (a server that answers /health but cannot generate)."""
        _, bodies = sglang_native.completion_bodies({"input_ids": [0], "sampling_params": {
            "max_new_tokens": 1, "temperature": 0}}, self.served[0])
        gen = self._completion(bodies[0])
        try:
            async with asyncio.timeout(sglang_native.HEALTH_GENERATE_TIMEOUT_S):
                async with self._choices(gen) as (_, pieces):
                    async for _ in pieces:
                        pass
        except (ApiError, TimeoutError) as exc:
            return web.Response(status=503, text=f"not generating: {exc or 'no token within the time'}\n")
        return web.Response(text="ok\n")

    # ---- answers --------------------------------------------------------------------------------------------
    def _logprobs(self, gen: Generation, piece: Piece, offset: int) -> dict | None:
        """The piece's `logprobs`: an echoed prompt's tokens (the first piece's) and then the generated ones."""
        if not gen.logprobs:
            return None
        text = self.token_text if self.token_text and not gen.tokens_as_ids else protocol.token_id_name
        data = self.token_bytes if gen.chat else None  # chat's entries carry the tokens' bytes
        # the prompt's tokens lead only an echo's (return_token_ids brings them too, unscored)
        lead = piece if gen.echo is not None else Piece()
        ids = lead.prompt_ids + piece.ids
        top = top_raw = None
        if gen.top_logprobs:  # (the server sends prompt_logprobs' count where that is more)
            n = gen.top_logprobs
            rows = list(zip(lead.prompt_top_ids + piece.top_ids, lead.prompt_top_log_probs + piece.top_log_probs))
            top = [None if row is None else [(text(t), v) for t, v in zip(row[:n], values)] for row, values in rows]
            top_raw = [None if row is None else [data(t) for t in row[:n]] for row, _ in rows] if data else None
        # named by id, a completion's text offsets still count the tokens' text
        widths = [len(self.token_text(t)) for t in ids] if gen.tokens_as_ids and self.token_text else None
        return protocol.logprobs_object(gen.chat, [text(t) for t in ids], lead.prompt_log_probs + piece.log_probs,
                                        offset, top, [data(t) for t in ids] if data else None, top_raw, widths)

    def _echoed(self, gen: Generation, index: int, piece: Piece, first: bool) -> Piece:
        """A piece as an echo request's client sees it: the choice's first starts with its prompt's text (the
        prompt's tokens and scores came with it); with max_tokens 0, nothing generated is sent."""
        if gen.echo is None:
            return piece
        if gen.score_only:
            piece = replace(piece, text="", ids=[], log_probs=[], top_ids=[], top_log_probs=[], stats={
                **piece.stats, **({tn.NUM_OUTPUT_TOKENS: 0} if tn.NUM_OUTPUT_TOKENS in piece.stats else {})})
        if not first:
            return piece
        prompt = gen.echo[index]
        return replace(piece, text=(prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) + piece.text)

    @staticmethod
    def _finish_reason(piece: Piece) -> str | None:
        if piece.finish_reason == tn.FINISH_CANCELLED:  # not a reason OpenAI's clients know
            raise ApiError(503, "the server cancelled the generation (it is stopping); retry", code="cancelled")
        return piece.finish_reason or None

    async def _answer(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        async with self._choices(gen, request if gen.stream else None) as (firsts, pieces):
            if gen.stream:
                return await self._stream(request, gen, firsts, pieces)
            return web.json_response(await self._whole(gen, pieces))

    async def _whole_answer(self, gen: Generation) -> dict:
        """A chat or completions request answered whole (a batch's): its JSON body."""
        async with self._choices(gen) as (_, pieces):
            return await self._whole(gen, pieces)

    @contextlib.asynccontextmanager
    async def _choices(self, gen: Generation, request: web.Request | None = None):
        """A chat or completions request's choices as (index, piece) pairs, every first awaited before they are
        handed over (errors before the first token are plain HTTP errors, unless a streamed `request` was kept
        alive meanwhile: `_waited`); the upstream streams closed on leaving. Yields (the first pieces, by index
        (None: none came), the pairs)."""
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(contextlib.aclosing(self.metrics.counted(
                self.upstream.generate(inputs, gen.logprobs, gen.server_top > 0, f"{gen.id}-{index}"),
                prompt=index % gen.n == 0,
                lora=_lora_name(inputs)))) for index, inputs in enumerate(gen.choices)]
            firsts = await self._waited(request, _guide_named(gen, _first_pieces(streams)))
            yield firsts, await stack.enter_async_context(contextlib.aclosing(_merged(streams, firsts)))

    async def _whole(self, gen: Generation, pieces) -> dict:
        merged = [Piece() for _ in gen.choices]
        seen = [False] * len(merged)
        async for index, piece in pieces:
            piece, seen[index] = self._echoed(gen, index, piece, not seen[index]), True
            merged[index].add(piece)
        choices = [self._whole_choice(gen, m, i) for i, m in enumerate(merged)]
        body = protocol.envelope(gen, choices, chunk=False)
        if gen.prompt_logprobs is not None:  # vLLM's: a chat's once (its choices share the prompt), else per choice
            name = self.token_text if self.token_text and not gen.tokens_as_ids else protocol.token_id_name
            scored = [protocol.prompt_logprobs(m.prompt_ids, m.prompt_log_probs, m.prompt_ranks, m.prompt_top_ids,
                                               m.prompt_top_log_probs, gen.prompt_logprobs, name) for m in merged]
            for entry, listed in ([(body, scored[0])] if gen.chat else zip(choices, scored)):
                entry["prompt_logprobs"] = listed
        if gen.return_token_ids:
            for entry, m in zip(choices, merged):
                protocol.add_token_ids(gen, body, entry, m.prompt_ids, m.ids, first=True)
        thinking = [self._reasoning_tokens(gen, m.ids) for m in merged]
        body["usage"] = protocol.combined_usage([m.stats for m in merged], [len(m.ids) for m in merged], gen.n,
                                                None if None in thinking else thinking, tn.PREDICTION in gen.sampling)
        body[STATS_FIELD] = protocol.combined_stats([m.stats for m in merged])
        return body

    def _whole_choice(self, gen: Generation, merged: Piece, index: int) -> dict:
        reason, text, calls, thinking = self._finish_reason(merged), merged.text, None, None
        if gen.reasoning is not None:  # calls are read from the answer, never from the thinking
            thinking, text = reasoning.split(text, gen.reasoning)
        if gen.tools is not None:
            text, found = tools.split_output(text or "", gen.tools)
            if found:
                calls, reason = tools.message_calls(found), gen.tools.finish_reason(reason)
        if gen.chat_echo:  # vLLM's chat echo: the assistant's last message leads the content
            text = gen.chat_echo + (text or "")
        return protocol.choice(gen, text, reason, self._logprobs(gen, merged, 0), delta=False, index=index,
                               tool_calls=calls, reasoning=thinking)

    async def _stream(self, request: web.Request, gen: Generation, firsts: list[Piece | None],
                      pieces) -> web.StreamResponse:
        response = await _event_stream(request)
        if gen.chat:  # the role chunks, sent with the first tokens so that a client's TTFT stays honest
            for index in range(len(gen.choices)):
                chunk = protocol.envelope(gen, [protocol.choice(gen, "", None, None, True, first=True, index=index)],
                                          chunk=True)
                if gen.return_token_ids and firsts[index] is not None:  # the prompt's, on the first chunk (vLLM's)
                    chunk["prompt_token_ids"] = firsts[index].prompt_ids
                await response.write(protocol.sse(chunk))
                if gen.chat_echo:  # vLLM's chat echo: the assistant's last message, a chunk of its own
                    await response.write(protocol.sse(protocol.envelope(gen, [protocol.choice(
                        gen, gen.chat_echo, None, None, True, index=index)], chunk=True)))
        count = len(gen.choices)
        sent_text, sent_ids, stats = [0] * count, [0] * count, [{} for _ in range(count)]
        generated: list[list[int]] = [[] for _ in range(count)]
        calls = [tools.ToolStream(gen.tools) for _ in range(count)] if gen.tools is not None else None
        thinkers = [reasoning.ReasoningStream(gen.reasoning) for _ in range(count)] if gen.reasoning else None
        seen, token_ids_sent = [False] * count, [False] * count
        try:
            async for index, piece in pieces:
                piece, seen[index] = self._echoed(gen, index, piece, not seen[index]), True
                stats[index].update(piece.stats)
                sent_ids[index] += len(piece.ids)
                if gen.include_usage and thinkers is not None:  # the thinking's tokens are counted at the end
                    generated[index] += piece.ids
                reason = self._finish_reason(piece)
                text, deltas, thinking = piece.text, None, ""
                if thinkers is not None:  # the thinking apart, as it comes
                    thinking, text = thinkers[index].feed(text)
                    if reason:
                        more_thinking, more_text = thinkers[index].finish()
                        thinking, text = thinking + more_thinking, text + more_text
                if calls is not None:  # the text becomes content and tool-call deltas as it comes
                    text, deltas = calls[index].feed(text)
                    if reason:
                        rest, more, called = calls[index].finish()
                        text, deltas = text + rest, deltas + more
                        reason = gen.tools.finish_reason(reason) if called else reason
                thinking = thinking if gen.include_reasoning else ""
                if not text and not deltas and not thinking and not reason and not (
                        (gen.logprobs or gen.return_token_ids) and piece.ids):
                    continue  # nothing to tell (e.g. text held back at a possible stop word)
                content = text if text or not (deltas or thinking) else None
                chunk = protocol.envelope(gen, [protocol.choice(gen, content, reason,
                                                                self._logprobs(gen, piece, sent_text[index]), True,
                                                                index=index, tool_calls=deltas, reasoning=thinking)],
                                          chunk=True)
                sent_text[index] += len(piece.text)
                if gen.return_token_ids:
                    protocol.add_token_ids(gen, chunk, chunk["choices"][0], piece.prompt_ids, piece.ids,
                                           first=not token_ids_sent[index])
                    token_ids_sent[index] = True
                if gen.include_usage:
                    chunk["usage"] = protocol.combined_usage(stats, sent_ids, gen.n, None, tn.PREDICTION in gen.sampling) \
                        if gen.continuous_usage else None
                if reason:  # this choice's own statistics, with its finish
                    chunk[STATS_FIELD] = protocol.combined_stats([stats[index]])
                await response.write(protocol.sse(chunk))
            if gen.include_usage:
                final = protocol.envelope(gen, [], chunk=True)
                thinking = [self._reasoning_tokens(gen, ids) for ids in generated]
                final["usage"] = protocol.combined_usage(stats, sent_ids, gen.n, None if None in thinking else thinking,
                                                         tn.PREDICTION in gen.sampling)
                await response.write(protocol.sse(final))
        except ApiError as exc:  # after the stream began: an error event, as OpenAI's SDK reads one
            self.metrics.stream_error(exc.status)
            await response.write(protocol.sse(exc.body()))
        await response.write(protocol.sse("[DONE]"))
        await response.write_eof()
        return response


def _page(items: list[dict], query, what: str) -> dict:
    """A list of items as OpenAI pages them: `limit` 1-100 (default 20), `order` desc (the default) or asc,
    `after` an item's id (ApiError naming the parameter)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise protocol.invalid("order", "must be asc or desc")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise protocol.invalid("limit", "must be an integer from 1 to 100")
    items = items if order == "asc" else items[::-1]
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            raise protocol.invalid("after", f"{query['after']!r} is not {what}")
        items = items[ids.index(query["after"]) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer's X-Request-Id (vLLM's, which a proxy's logs join on): a chat's or completion's id as
    its answer gives it, else the request's own header, else a new one."""
    response.headers[protocol.REQUEST_ID_HEADER] = request.get(_REQUEST_ID) or request.headers.get(
        protocol.REQUEST_ID_HEADER) or uuid.uuid4().hex


async def _event_stream(request: web.Request) -> web.StreamResponse:
    """The request's Server-Sent Events answer, prepared (its headers sent) the first time it is asked for."""
    response = request.get(_PREPARED)
    if response is None:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        request[_PREPARED] = response
    return response


async def _guide_named(gen: Generation, first):
    """`first` awaited; a refusal of the request's guide names the field it came from (protocol.guide_error)."""
    try:
        return await first
    except ApiError as exc:
        raise protocol.guide_error(exc, gen.guide_field) from None


async def _first_pieces(streams: list) -> list[Piece | None]:
    """Every choice's first response (None: a stream that ended without one). With several, all are awaited
    before any error is raised, so that no stream is left running while it is closed."""
    if len(streams) == 1:
        return [await anext(streams[0], None)]
    firsts = await asyncio.gather(*(anext(stream, None) for stream in streams), return_exceptions=True)
    for first in firsts:
        if isinstance(first, BaseException):
            raise first
    return firsts


async def _merged(streams: list, firsts: list[Piece | None]):
    """(choice index, piece) of every choice as its responses come. One choice is read in place; several
    each by a task of their own into one queue, the first error raised as it comes; closing the iterator
    (the answer is done, or the client went away) cancels the tasks still reading, which cancels their
    requests on the server."""
    if len(streams) == 1:
        if firsts[0] is not None:
            yield 0, firsts[0]
            async for piece in streams[0]:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def read(index: int, stream, first: Piece | None) -> None:
        try:
            if first is not None:
                queue.put_nowait((index, first))
                async for piece in stream:
                    queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the answer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(read(i, stream, first)) for i, (stream, first) in enumerate(zip(streams, firsts))]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _StreamedItem:
    """A streamed response's message (or reasoning) item: opened with its first text at the output index it
    then takes (added events), then text deltas, closed by `done` (the done events) into the output item."""

    def __init__(self, kind: str, item_id: str, send):
        self.kind, self.item_id, self.send = kind, item_id, send
        self.text, self.index, self.opened, self.closed = "", 0, False, False
        self.family = "output_text" if kind == "message" else "reasoning_text"  # its part's type and events'
        # A message's tokens' log-probabilities (with include: message.output_text.logprobs): all of them, and
        # where the next text delta starts sending them (a delta sends those that came since the last one)
        self.logprobs: list[dict] = []
        self.logprobs_sent = 0

    def _item(self, status: str) -> dict:
        done = status == "completed"
        if self.kind == "message":
            return responses.message_item(self.text, status, self.item_id, self.logprobs)
        return responses.reasoning_item(self.text if done else None, status, self.item_id)

    def _part(self, text: str, logprobs: list[dict] | None = None) -> dict:
        return responses.output_text(text, logprobs) if self.kind == "message" else responses.reasoning_text(text)

    async def add(self, text: str, index: int) -> None:
        if not text:
            return
        if not self.opened:
            await self._open(index)
        self.text += text
        extra = {}
        if self.kind == "message":
            extra["logprobs"], self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        await self.send(f"response.{self.family}.delta", item_id=self.item_id, output_index=self.index,
                        content_index=0, delta=text, **extra)

    async def done(self, index: int = 0) -> dict:
        if not self.opened:
            await self._open(index)
        where = dict(item_id=self.item_id, output_index=self.index, content_index=0)
        extra = {"logprobs": self.logprobs} if self.kind == "message" else {}
        await self.send(f"response.{self.family}.done", **where, text=self.text, **extra)
        await self.send("response.content_part.done", **where, part=self._part(self.text, self.logprobs))
        item = self._item("completed")
        await self.send("response.output_item.done", output_index=self.index, item=item)
        self.closed = True
        return item

    async def _open(self, index: int) -> None:
        self.opened, self.index = True, index
        await self.send("response.output_item.added", output_index=index, item=self._item("in_progress"))
        await self.send("response.content_part.added", item_id=self.item_id, output_index=index, content_index=0,
                        part=self._part(""))


def _lora_name(inputs: dict) -> str:
    """The LoRA adapter a choice's inputs run ("": the base model)."""
    given = inputs.get(tn.LORA_NAME)
    return given.reshape(-1)[0].decode() if given is not None and given.size else ""
