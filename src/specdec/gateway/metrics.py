"""The OpenAI API's own Prometheus metrics, served at `GET /metrics` on its port: what its clients see of it,
which the server's metrics (Triton's port) cannot tell: requests by endpoint and HTTP status (the API's own
refusals, clients that went away), their time through the API, the time to the first token since a request
reached it, tokens by endpoint, and the Responses API's stored and background responses.

docs/deployment.md lists them. A request's record (`Call`) lives in a context variable set by the app's
middleware: the tasks a handler starts (several choices' streams, a background response) copy the context
and so count under the request that started them.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from typing import AsyncIterator

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import GaugeMetricFamily

from specdec import tensor_names as tn
from specdec.triton.metrics import LATENCY_BUCKETS  # the server's own, so that their quantiles compare

PATH = "/metrics"
CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED = "unmatched"  # the endpoint of a request no route serves (an unknown path, a method not allowed)
DISCONNECTED = "disconnected"  # the code of a request whose client went away before its answer ended
METHODS = frozenset({"GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"})  # others count as "other"


@dataclass
class Call:
    """One HTTP request as the metrics follow it."""

    method: str
    endpoint: str
    started: float  # time.monotonic() at its arrival
    first_token: bool = False  # its first generated token was counted (time to first token)
    stream_error: int | None = None  # the status of an error event sent after a streamed answer began


_CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("specdec_openai_call", default=None)


def endpoint_of(route_resource) -> str:
    """A route's label: its path as registered (`/v1/responses/{id}`, not the id asked for), so that the
    labels stay a fixed set; UNMATCHED where no route matched."""
    return route_resource.canonical if route_resource is not None else UNMATCHED


class ApiMetrics:
    """The API process's metrics, in a registry of its own (one per app: tests run several in a process)."""

    def __init__(self, store=None, background=None, conversations=None, files=None, batches=None):
        """store: the Responses API's (response_store; its usage() read at each scrape); background: the
        BackgroundResponses (len(): those generating in this process); conversations, files: the conversations'
        and the files' contents' stores; batches: the Batch API's Batches (len(): those running here). None: not reported."""
        disable_created_metrics()  # no `_created` series per label set: nothing here reads them
        self.registry = registry = CollectorRegistry()
        self.lora_running: dict[str, int] = {}  # generations now running each LoRA adapter (vllm_metrics)
        by_route = ["method", "endpoint"]
        self.requests = Counter("specdec_openai_requests", "HTTP requests answered by the OpenAI API, by method, "
                                "endpoint (its route) and code (the HTTP status; an error event after a streamed "
                                "answer began counts with its status; 'disconnected': the client went away first)",
                                by_route + ["code"], registry=registry)
        self.running = Gauge("specdec_openai_requests_running", "HTTP requests the OpenAI API is answering now",
                             by_route, registry=registry)
        self.duration = Histogram("specdec_openai_request_duration_seconds", "A request's arrival at the OpenAI API "
                                  "to the end of its answer (a streamed answer: its last event)", by_route,
                                  buckets=LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram("specdec_openai_time_to_first_token_seconds", "A request's arrival at the "
                                     "OpenAI API to its first generated token reaching the API (streamed: sent on as "
                                     "it comes; several choices: the first of any)", by_route,
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("specdec_openai_prompt_tokens", "Prompt tokens of the requests the OpenAI API "
                                     "generated for (as their usage counts them: each prompt once, its n choices "
                                     "sharing it)", by_route, registry=registry)
        self.cached_tokens = Counter("specdec_openai_cached_prompt_tokens", "Of those prompt tokens, the ones the "
                                     "server's prefix cache held (usage's cached_tokens; ÷ prompt tokens = the hit "
                                     "rate of the API's traffic)", by_route, registry=registry)
        self.completion_tokens = Counter("specdec_openai_completion_tokens", "Tokens generated for the OpenAI "
                                         "API's requests (every choice's)", by_route, registry=registry)
        if any(part is not None for part in (store, background, conversations, files, batches)):
            registry.register(_Responses(store, background, conversations, files, batches))

    # ---- a request --------------------------------------------------------------------------------------
    def begin(self, method: str, endpoint: str) -> Call:
        """A request arrived: it runs, and the tasks its handler starts count under it."""
        call = Call(method if method in METHODS else "other", endpoint, time.monotonic())
        _CALL.set(call)
        self.running.labels(call.method, call.endpoint).inc()
        return call

    def end(self, call: Call, code: int | str) -> None:
        """The request's answer ended: with its HTTP status, or DISCONNECTED."""
        if call.stream_error is not None and code != DISCONNECTED:
            code = call.stream_error
        self.running.labels(call.method, call.endpoint).dec()
        self.requests.labels(call.method, call.endpoint, str(code)).inc()
        self.duration.labels(call.method, call.endpoint).observe(time.monotonic() - call.started)

    @staticmethod
    def stream_error(status: int) -> None:
        """The current request's streamed answer ended in an error event of this status (its HTTP status,
        sent before, was 200)."""
        call = _CALL.get()
        if call is not None:
            call.stream_error = status

    async def counted(self, stream: AsyncIterator, prompt: bool = True, lora: str = "") -> AsyncIterator:
        """A generation's pieces (upstream.Piece) passed on, its tokens and the request's first token counted
        under the current request. prompt: count its prompt's tokens (the first of a request's choices).
        lora: the adapter it runs, counted among the running ones while it generates (`lora_running`)."""
        call = _CALL.get()
        prompt_tokens = cached_tokens = 0
        if lora:
            self.lora_running[lora] = self.lora_running.get(lora, 0) + 1
        try:
            async for piece in stream:
                if call is not None and piece.ids:
                    self.completion_tokens.labels(call.method, call.endpoint).inc(len(piece.ids))
                    if not call.first_token:
                        call.first_token = True
                        self.first_token.labels(call.method, call.endpoint).observe(time.monotonic() - call.started)
                prompt_tokens = int(piece.stats.get(tn.NUM_INPUT_TOKENS, prompt_tokens))
                cached_tokens = int(piece.stats.get(tn.NUM_CACHED_TOKENS, cached_tokens))
                yield piece
        finally:
            if lora:
                self.lora_running[lora] -= 1
                if not self.lora_running[lora]:
                    del self.lora_running[lora]
            await stream.aclose()
            if call is not None and prompt and prompt_tokens:
                self.prompt_tokens.labels(call.method, call.endpoint).inc(prompt_tokens)
                self.cached_tokens.labels(call.method, call.endpoint).inc(cached_tokens)

    def page(self) -> bytes:
        """The Prometheus text of every metric (reads a shared store's directory: call it off the event loop)."""
        return generate_latest(self.registry)


class _Responses:
    """The Responses API's stored and background responses, read when scraped."""

    def __init__(self, store, background, conversations, files=None, batches=None):
        self.store, self.background, self.conversations = store, background, conversations
        self.files, self.batches = files, batches

    def describe(self):
        return []  # read at each scrape only (registering reads nothing)

    def collect(self):
        kept = ((self.store, "specdec_openai_stored_responses", "Responses the Responses API keeps",
                 "specdec_openai_stored_response_bytes", "Bytes of those responses"),
                (self.conversations, "specdec_openai_conversations", "Conversations the Conversations API keeps",
                 "specdec_openai_conversation_bytes", "Bytes of those conversations' items"),
                (self.files, "specdec_openai_files", "Files the Files API keeps (batches' inputs and outputs)",
                 "specdec_openai_file_bytes", "Bytes of those files"))
        for store, count_name, count_help, bytes_name, bytes_help in kept:
            if store is not None and store.enabled:
                count, size = store.usage()
                yield GaugeMetricFamily(count_name, count_help + " (a store shared by replicas: the directory's, the "
                                        "same from each)", value=count)
                yield GaugeMetricFamily(bytes_name, bytes_help + " (their budget: --responses-store-mb)", value=size)
        if self.background is not None:
            yield GaugeMetricFamily("specdec_openai_background_responses", "Background responses this API process "
                                    "is generating now", value=len(self.background))
        if self.batches is not None:
            yield GaugeMetricFamily("specdec_openai_batches_running", "Batches (the Batch API's) this API process is "
                                    "answering now", value=len(self.batches))
