"""Locust load test of the speculative decoding ensemble: gRPC streaming, HTTP generate_stream, OpenAI API,
Anthropic Messages API and vLLM-backend-client users.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host localhost:8001          # gRPC
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host localhost:8001 VllmBackendUser
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:8000   # HTTP
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:9000/v1  # OpenAI API
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:9000/v1 OpenAICompletionsUser
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:9000/v1 AnthropicUser

The host picks the user class (.../v1 -> OpenAIUser: streamed chat completions with usage; other http://
-> HttpStreamUser; else GrpcStreamUser) unless classes are named on the command line. OpenAIUser sends
temperature 0 unless --temperature says otherwise (OpenAI's default, 1, would make its runs incomparable
with the other users'), the model --openai-model (SPECDEC_OPENAI_MODEL; default: the first /v1/models
lists) and the key SPECDEC_API_KEY if set. VllmBackendUser sends its requests to vllm_compatible as the clients of
Triton's vLLM backend do; --vllm-fraction (SPECDEC_VLLM_FRACTION, 0) sends that share of GrpcStreamUser's so,
and --openai-fraction (SPECDEC_OPENAI_FRACTION, 0) that share as chat completions to the API at --openai-url.
Each request is one entry in Locust's statistics ("generate"); its time to first token,
inter-token latency, output tokens and acceptance are kept beside them (as entries they would add to
Locust's aggregated request rate), and at the end the summary prints requests, failures, TTFT
p50/p90/p99, ITL p50/p90, output tokens/s and mean acceptance rate (genai-perf definitions); with --csv
PREFIX they also go to PREFIX_specdec.csv. Distributed runs (--processes N, or --master/--worker) work:
workers send their samples to the master with every stats report and the master prints the summary. Options (or environment): --max-tokens (SPECDEC_MAX_TOKENS, 64),
--num-draft-tokens (SPECDEC_NUM_DRAFT_TOKENS, server default), --num-draft-branches
(SPECDEC_NUM_DRAFT_BRANCHES, server default), --temperature (SPECDEC_TEMPERATURE),
--prompts-file (SPECDEC_PROMPTS, loadtest/prompts.jsonl), --prompt-kind (SPECDEC_PROMPT_KIND: all |
grounded | open), --guided-fraction (SPECDEC_GUIDED_FRACTION, 0: the share of requests that carry a guide,
structured output) with --guides-file (SPECDEC_GUIDES, loadtest/guided.jsonl: prompt, guide_type, guide),
--system-prompt-file (SPECDEC_SYSTEM_PROMPT, none: a text every prompt starts with, as a shared system prompt
does; loadtest/system_prompt.txt is one; the server's prefix caching computes it once), --mix (SPECDEC_MIX:
mixed traffic, `MIX`: streamed or not, seeded sampling, penalties, clients cancelling mid-stream,
whose requests count as "cancelled" in Locust's table; the gRPC and OpenAI users).
"""

# gRPC must be made gevent-cooperative before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import csv  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent.queue  # noqa: E402
import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import requests  # noqa: E402
from locust import User, events, task  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

from client.core import GenerationParams, ResultBuilder  # noqa: E402
from client.core import classify_error, classify_http_error  # noqa: E402
from client.sync import STREAM_CHUNK, consume_grpc_response, grpc_inputs, is_final, parse_sse_line  # noqa: E402
from client.sync import sse_lines  # noqa: E402
from specdec import tensor_names as tn  # noqa: E402

HERE = Path(__file__).resolve().parent


@events.init_command_line_parser.add_listener
def _options(parser):
    env = os.environ.get
    parser.add_argument("--max-tokens", type=int, default=int(env("SPECDEC_MAX_TOKENS", "64")))
    parser.add_argument("--num-draft-tokens", type=int,
                        default=int(env("SPECDEC_NUM_DRAFT_TOKENS")) if env("SPECDEC_NUM_DRAFT_TOKENS") else None)
    parser.add_argument("--num-draft-branches", type=int,
                        default=int(env("SPECDEC_NUM_DRAFT_BRANCHES")) if env("SPECDEC_NUM_DRAFT_BRANCHES") else None,
                        help="a draft model's trees at most this wide (1: chains); unset: the server's draft_branches")
    parser.add_argument("--temperature", type=float,
                        default=float(env("SPECDEC_TEMPERATURE")) if env("SPECDEC_TEMPERATURE") else None)
    parser.add_argument("--draft-model", default=env("SPECDEC_DRAFT_MODEL") or None,
                        help="the draft method every request asks for (a draft model, ngram, suffix); "
                             "unset: the server's default")
    parser.add_argument("--lora-names", default=env("SPECDEC_LORA_NAMES", ""),
                        help="comma-separated LoRA adapters the requests spread over, each request one at random "
                             "(an empty entry: the base model; OpenAI users send it as the model); unset: none")
    parser.add_argument("--prompts-file", default=env("SPECDEC_PROMPTS", str(HERE / "prompts.jsonl")))
    parser.add_argument("--prompt-kind", default=env("SPECDEC_PROMPT_KIND", "all"), choices=("all", "grounded", "open"))
    parser.add_argument("--guided-fraction", type=float, default=float(env("SPECDEC_GUIDED_FRACTION", "0")))
    parser.add_argument("--guides-file", default=env("SPECDEC_GUIDES", str(HERE / "guided.jsonl")))
    parser.add_argument("--system-prompt-file", default=env("SPECDEC_SYSTEM_PROMPT", ""))
    parser.add_argument("--openai-model", default=env("SPECDEC_OPENAI_MODEL", ""))
    parser.add_argument("--vllm-fraction", type=float, default=float(env("SPECDEC_VLLM_FRACTION", "0")),
                        help="gRPC users: the share of requests sent as vLLM's Triton backend's clients send them, "
                             "to vllm_compatible (VllmBackendUser: all)")
    parser.add_argument("--openai-fraction", type=float, default=float(env("SPECDEC_OPENAI_FRACTION", "0")),
                        help="gRPC users: the share of requests sent as chat completions to the OpenAI API at "
                             "--openai-url (its own \"openai\" entry)")
    parser.add_argument("--openai-url", default=env("SPECDEC_OPENAI_URL", ""),
                        help="the OpenAI API's base URL for --openai-fraction (http://host:9000/v1)")
    parser.add_argument("--mix", action="store_true", default=env("SPECDEC_MIX", "") not in ("", "0"),
                        help="mixed traffic (gRPC and OpenAI users): streamed or not, greedy or seeded sampling, "
                             "penalties on some, and a share of clients that cancel mid-stream")


class Samples:
    """Per-request measurements for the end-of-run summary. Times are wall-clock (time.time()) so that
    samples of several worker processes combine on the master."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.itl, self.acceptance = [], [], []
        self.output_tokens = 0
        self.first_sent = None
        self.last_done = None

    def add(self, sent_perf: float, result) -> None:
        sent = time.time() - (time.perf_counter() - sent_perf)
        self.merge({"ttft": [result.ttft_s], "itl": [result.itl_s] if result.num_output_tokens > 1 else [],
                    "acceptance": [result.acceptance_rate] if result.total_draft_tokens else [],
                    "tokens": result.num_output_tokens, "first": sent, "last": sent + result.latency_s})

    def merge(self, data: dict | None) -> None:
        """Add samples (one request's, or a worker's report)."""
        if not data:
            return
        with self.lock:
            self.ttft += data["ttft"]
            self.itl += data["itl"]
            self.acceptance += data["acceptance"]
            self.output_tokens += data["tokens"]
            if data["first"] is not None:
                self.first_sent = data["first"] if self.first_sent is None else min(self.first_sent, data["first"])
                self.last_done = data["last"] if self.last_done is None else max(self.last_done, data["last"])

    def take(self) -> dict:
        """Everything since the last take, removed here (what a worker sends to the master)."""
        with self.lock:
            data = {"ttft": self.ttft, "itl": self.itl, "acceptance": self.acceptance, "tokens": self.output_tokens,
                    "first": self.first_sent, "last": self.last_done}
            self.ttft, self.itl, self.acceptance, self.output_tokens = [], [], [], 0
            self.first_sent = self.last_done = None
            return data


SAMPLES = Samples()


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


@events.init.add_listener
def _pick_user_class(environment, **_kwargs):
    options = environment.parsed_options
    if options is None or getattr(options, "user_classes", None) or not environment.host:
        return
    if environment.host.rstrip("/").endswith("/v1"):
        wanted = OpenAIUser
    else:
        wanted = HttpStreamUser if environment.host.startswith(("http://", "https://")) else GrpcStreamUser
    environment.user_classes = [wanted]


@events.report_to_master.add_listener
def _send_samples(client_id, data, **_kwargs):
    data["specdec"] = SAMPLES.take()


@events.worker_report.add_listener
def _receive_samples(client_id, data, **_kwargs):
    SAMPLES.merge(data.get("specdec"))


@events.quitting.add_listener
def _summary(environment, **_kwargs):
    if isinstance(environment.runner, WorkerRunner):
        return  # the master has this worker's samples and prints the summary
    entries = [entry for (name, _kind), entry in environment.stats.entries.items() if name == "generate"]
    requests_done = sum(e.num_requests for e in entries)
    failures = sum(e.num_failures for e in entries)
    duration = (SAMPLES.last_done - SAMPLES.first_sent) if SAMPLES.first_sent is not None else 0.0
    tokens_per_s = SAMPLES.output_tokens / duration if duration > 0 else 0.0
    acceptance = sum(SAMPLES.acceptance) / len(SAMPLES.acceptance) if SAMPLES.acceptance else 0.0
    lines = [
        "",
        "speculative decoding load summary",
        f"  requests            {requests_done}",
        f"  failures            {failures}",
        f"  TTFT p50/p90/p99    {percentile(SAMPLES.ttft, 50) * 1000:.0f} / {percentile(SAMPLES.ttft, 90) * 1000:.0f}"
        f" / {percentile(SAMPLES.ttft, 99) * 1000:.0f} ms",
        f"  ITL p50/p90         {percentile(SAMPLES.itl, 50) * 1000:.1f} / {percentile(SAMPLES.itl, 90) * 1000:.1f} ms",
        f"  output tokens/s     {tokens_per_s:.1f}  ({SAMPLES.output_tokens} tokens in {duration:.1f} s)",
        # vllm_compatible's responses carry no acceptance (vLLM's outputs): "n/a" when no request's did
        f"  mean acceptance     {acceptance:.3f}" if SAMPLES.acceptance else "  mean acceptance     n/a",
    ]
    print("\n".join(lines), flush=True)
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_specdec.csv", "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["metric", "count", "p50", "p90", "p99", "mean"])
            for name, values, scale in (("ttft_ms", SAMPLES.ttft, 1000), ("itl_ms", SAMPLES.itl, 1000),
                                        ("acceptance", SAMPLES.acceptance, 1)):
                mean = sum(values) / len(values) * scale if values else float("nan")
                writer.writerow([name, len(values)] + [f"{percentile(values, q) * scale:.3f}" for q in (50, 90, 99)]
                                + [f"{mean:.3f}"])
            writer.writerow(["output_tokens_per_s", SAMPLES.output_tokens, "", "", "", f"{tokens_per_s:.3f}"])


class _SpecdecMixin:
    """Prompt choice, parameters and recording shared by both user classes."""

    request_type = "?"

    def on_start(self):
        options = self.environment.parsed_options
        path = Path(getattr(options, "prompts_file", HERE / "prompts.jsonl"))
        kind = getattr(options, "prompt_kind", "all")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        self.prompts = [r["prompt"] for r in rows if kind == "all" or r.get("kind") == kind]
        if not self.prompts:
            raise ValueError(f"no prompts of kind {kind!r} in {path}")
        self.params = GenerationParams(max_tokens=getattr(options, "max_tokens", 64),
                                       num_draft_tokens=getattr(options, "num_draft_tokens", None),
                                       num_draft_branches=getattr(options, "num_draft_branches", None),
                                       temperature=getattr(options, "temperature", None),
                                       draft_model=getattr(options, "draft_model", None))
        self.guided_fraction = getattr(options, "guided_fraction", 0.0)
        if not 0.0 <= self.guided_fraction <= 1.0:
            raise ValueError(f"--guided-fraction must be within [0, 1], got {self.guided_fraction}")
        self.guided = []
        if self.guided_fraction:
            path = Path(getattr(options, "guides_file", HERE / "guided.jsonl"))
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    guide = row["guide"] if isinstance(row["guide"], str) else json.dumps(row["guide"])
                    self.guided.append((row["prompt"], dataclasses.replace(self.params, guide_type=row["guide_type"],
                                                                           guide=guide)))
            if not self.guided:
                raise ValueError(f"no guided requests in {path}")
        system = getattr(options, "system_prompt_file", "")
        self.system = Path(system).read_text().strip() + "\n\n" if system else ""

    def request(self) -> tuple[str, GenerationParams]:
        """The next request's prompt (after the shared system prompt, if any) and parameters: a guided one
        with probability --guided-fraction; with --mix, sampled (seeded) half the time and penalised a fifth."""
        if self.guided and random.random() < self.guided_fraction:
            prompt, params = random.choice(self.guided)
        else:
            prompt, params = random.choice(self.prompts), self.params
        adapters = getattr(self.environment.parsed_options, "lora_names", "")
        if adapters:  # multi-LoRA traffic: each request one adapter, or the base model for an empty entry
            params = dataclasses.replace(params, lora_name=random.choice(adapters.split(",")).strip() or None)
        if getattr(self.environment.parsed_options, "mix", False):
            if random.random() < MIX["sampled"]:
                params = dataclasses.replace(params, temperature=0.8, top_p=0.95, seed=random.getrandbits(31))
            if random.random() < MIX["penalised"]:
                params = dataclasses.replace(params, repetition_penalty=1.1, presence_penalty=0.3)
        return self.system + prompt, params

    def shape(self) -> tuple[bool, bool]:
        """(streamed, cancelled): with --mix a share answered whole and a share of the streamed ones left by
        their client after the first token (MIX); else streamed to the end."""
        mix = getattr(self.environment.parsed_options, "mix", False)
        streamed = not (mix and random.random() < MIX["whole"])
        return streamed, mix and streamed and random.random() < MIX["cancelled"]

    def through_api(self, api: "ChatApi", streamed: bool, cancel: bool, request_type: str | None = None) -> None:
        """The next request sent through an OpenAI-compatible API (ChatApi.send), recorded."""
        builder, exception = ResultBuilder(), None
        try:
            api.send(builder, *self.request(), streamed, cancel)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded as one
            exception = exc
        self.record(builder.sent, builder.result, exception, request_type, cancel)

    def record(self, sent: float, result, exception, request_type: str | None = None, cancelled: bool = False) -> None:
        """One request in Locust's table: "generate" with its time and tokens, or a "cancelled" one (its client
        left mid-stream: no sample; a failure before that is a failed "generate")."""
        name = "cancelled" if cancelled and exception is None else "generate"
        if name == "generate" and exception is None:
            SAMPLES.add(sent, result)
        self.environment.events.request.fire(request_type=request_type or self.request_type, name=name,
             response_time=(time.perf_counter() - sent) * 1000,
             response_length=result.num_output_tokens if result and name == "generate" else 0,
             exception=exception, context={})


# --mix: the share of requests that sample (seeded), that carry penalties, that are not streamed (one
# response at the end), and whose client cancels after the first streamed response.
MIX = {"sampled": 0.5, "penalised": 0.2, "whole": 0.3, "cancelled": 0.1}


class GeventGrpcClient(grpcclient.InferenceServerClient):
    """tritonclient's gRPC client closed only explicitly: closing a channel from __del__ at interpreter
    exit hangs under gevent (seen), so on_stop / test_stop close it while the hub still runs."""

    def __del__(self):
        pass


OPEN_GRPC_CLIENTS: set = set()


@events.test_stop.add_listener
def _close_grpc_clients(**_kwargs):
    # Users killed at the time limit skip on_stop; a channel left to __del__ at interpreter exit hangs
    # under gevent, so close every channel while the hub is still running.
    while OPEN_GRPC_CLIENTS:
        OPEN_GRPC_CLIENTS.pop().close()


# A guide of the load test's guides file as vLLM's `structured_outputs` object (its OpenAI API's and its Triton
# backend's sampling_parameters' key).
_STRUCTURED_OUTPUTS = {"json": lambda guide: {"json_object": True},
                       "json_schema": lambda guide: {"json": json.loads(guide)},
                       "regex": lambda guide: {"regex": guide}, "ebnf_grammar": lambda guide: {"grammar": guide},
                       "choice": lambda guide: {"choice": json.loads(guide)},
                       "structural_tag": lambda guide: {"structural_tag": json.loads(guide)}}
# Settings of GenerationParams that vLLM's sampling_parameters JSON takes under the same name
_VLLM_SETTINGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "ignore_eos", "lora_name")
# This server's speculation inputs that vllm_compatible takes beside vLLM's, with their types
_VLLM_SPECULATION = ((tn.DRAFT_MODEL, "draft_model", np.object_), (tn.NUM_DRAFT_TOKENS, "num_draft_tokens", np.int32),
                     (tn.NUM_DRAFT_BRANCHES, "num_draft_branches", np.int32))


def vllm_request(prompt: str, params: GenerationParams, stream: bool) -> dict[str, np.ndarray]:
    """A request as vLLM's Triton backend's clients send it (to vllm_compatible): [1]-shaped tensors (its model
    has max_batch_size 0), the settings as one sampling_parameters JSON, the text without the prompt, and each
    response's token count (return_num_output_tokens); this server's speculation inputs beside them."""
    settings = {key: value for key in _VLLM_SETTINGS if (value := getattr(params, key)) is not None}
    if params.guide_type:
        settings["structured_outputs"] = _STRUCTURED_OUTPUTS[params.guide_type](params.guide)
    arrays = {tn.TEXT_INPUT: np.array([prompt.encode()], dtype=np.object_), tn.STREAM: np.array([stream]),
              tn.SAMPLING_PARAMETERS: np.array([json.dumps(settings).encode()], dtype=np.object_),
              tn.EXCLUDE_INPUT_IN_OUTPUT: np.array([True]), tn.RETURN_NUM_OUTPUT_TOKENS: np.array([True])}
    for name, key, dtype in _VLLM_SPECULATION:
        value = getattr(params, key)
        if value is not None:
            arrays[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=dtype)
    return arrays


def consume_vllm_response(builder: ResultBuilder, result, error) -> bool:
    """Add one of vllm_compatible's streamed responses to the result (its text; num_output_tokens counts the
    response's own tokens, vLLM's meaning, so they are summed); True when it was the request's last."""
    if error is not None:
        raise classify_error(error.message(), str(error.status()))
    if result.get_response().outputs:
        text = "".join(item.decode() for item in result.as_numpy(tn.TEXT_OUTPUT).reshape(-1))
        tokens = int(result.as_numpy(tn.NUM_OUTPUT_TOKENS).sum())
        builder.add({tn.TEXT_OUTPUT: text, tn.NUM_OUTPUT_TOKENS: builder.result.num_output_tokens + tokens})
    return is_final(result)


class GrpcStreamUser(_SpecdecMixin, User):
    """Streams every request over gRPC ModelStreamInfer (host: host:port of the gRPC endpoint): to `ensemble`, or
    with --vllm-fraction a share of them to `vllm_compatible` as vLLM's backend's clients send them (their own
    "vllm" entry in Locust's table; no acceptance: vLLM's outputs have none), and with --openai-fraction a share
    as chat completions to the OpenAI API at --openai-url (their own "openai" entry), mixed alike."""

    request_type = "grpc"
    vllm_fraction: float | None = None  # None: --vllm-fraction

    def on_start(self):
        super().on_start()
        options = self.environment.parsed_options
        if self.vllm_fraction is None:
            self.vllm_fraction = getattr(options, "vllm_fraction", 0.0)
        self.openai_fraction = getattr(options, "openai_fraction", 0.0)
        for name, share in (("--vllm-fraction", self.vllm_fraction), ("--openai-fraction", self.openai_fraction)):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {share}")
        if self.vllm_fraction + self.openai_fraction > 1.0:
            raise ValueError(f"--vllm-fraction and --openai-fraction add up to more than 1 "
                             f"({self.vllm_fraction} + {self.openai_fraction})")
        self.api = None
        if self.openai_fraction:
            if not getattr(options, "openai_url", ""):
                raise ValueError("--openai-fraction needs --openai-url (the API's base URL, http://host:9000/v1)")
            self.api = ChatApi(options.openai_url, getattr(options, "openai_model", ""))
        self.client = GeventGrpcClient(self.host.replace("grpc://", ""))
        OPEN_GRPC_CLIENTS.add(self.client)

    def on_stop(self):
        if self.api is not None:
            self.api.close()
        if self.client in OPEN_GRPC_CLIENTS:
            OPEN_GRPC_CLIENTS.discard(self.client)
            self.client.close()

    @task
    def generate(self):
        streamed, cancel = self.shape()
        draw = random.random()  # one draw for the path: the shares do not overlap
        if draw < self.openai_fraction:
            self.through_api(self.api, streamed, cancel, OpenAIUser.request_type)
            return
        vllm = draw < self.openai_fraction + self.vllm_fraction
        responses: gevent.queue.Queue = gevent.queue.Queue()
        builder = ResultBuilder()
        sent = builder.sent
        exception = None
        request_type = "vllm" if vllm else self.request_type
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            prompt, params = self.request()
            if vllm:
                model, arrays = tn.VLLM_COMPATIBLE, vllm_request(prompt, params, streamed)
                consume = consume_vllm_response
            else:
                model, arrays = tn.ENSEMBLE, params.tensors(prompt, streamed)
                consume = lambda *response: consume_grpc_response(*response, None)  # noqa: E731
            self.client.async_stream_infer(model, grpc_inputs(arrays), enable_empty_final_response=True)
            while not consume(builder, *responses.get(timeout=600)):
                if cancel and builder.first is not None:
                    break  # the client walks away mid-stream: the stream is closed with cancel_requests below
        except Exception as exc:  # noqa: BLE001 - every failure is recorded as one
            exception = exc
        finally:
            self.client.stop_stream(cancel_requests=cancel)
        self.record(sent, builder.result, exception, request_type, cancel)


class VllmBackendUser(GrpcStreamUser):
    """Streams every request to `vllm_compatible` as the clients of Triton's vLLM backend send them ([1]-shaped
    tensors, one sampling_parameters JSON; host: host:port of the gRPC endpoint; name the class on the command
    line): TTFT at the first response, output tokens summed from each response's num_output_tokens, no
    acceptance (vLLM's outputs carry none)."""

    request_type = "vllm"
    vllm_fraction = 1.0


class HttpStreamUser(_SpecdecMixin, User):
    """Streams every request over HTTP /v2/models/ensemble/generate_stream (host: http://host:port).

    A plain requests session (gevent-patched by Locust) rather than HttpUser's client, so each request
    is recorded once, by us, with its TTFT and ITL.
    """

    request_type = "http"

    def on_start(self):
        super().on_start()
        self.session = requests.Session()

    def on_stop(self):
        self.session.close()

    @task
    def generate(self):
        builder = ResultBuilder()
        sent = builder.sent
        exception = None
        prompt, params = self.request()
        body = params.json(prompt, True)
        try:
            with self.session.post(f"{self.host.rstrip('/')}/v2/models/{tn.ENSEMBLE}/generate_stream", json=body,
                                   stream=True, timeout=(10, 600)) as response:
                if response.status_code != 200:
                    raise classify_http_error(response.status_code, response.text)
                for line in sse_lines(response.iter_content(chunk_size=STREAM_CHUNK)):
                    payload = parse_sse_line(line)
                    if payload is not None:
                        builder.add(payload)
        except Exception as exc:  # noqa: BLE001
            exception = exc
        self.record(sent, builder.result, exception)


class ChatApi:
    """An OpenAI-compatible API's client (base: its URL, http://host:9000/v1): one plain requests session
    (gevent-patched by Locust), the key SPECDEC_API_KEY if set, the model `model` or the first /v1/models lists.
    `send` makes one chat completion, streamed with stream_options.include_usage or answered whole: TTFT at the
    first chunk with content, output tokens from `usage`, acceptance from the `speculative_decoding` statistics."""

    path = "/chat/completions"

    def __init__(self, base: str, model: str = ""):
        self.session = requests.Session()
        key = os.environ.get("SPECDEC_API_KEY")
        if key:
            self.authorize(key)
        self.base = base.rstrip("/")
        self.model = model or self.session.get(f"{self.base}/models", timeout=30).json()["data"][0]["id"]

    def authorize(self, key: str) -> None:
        self.session.headers["Authorization"] = f"Bearer {key}"

    def close(self) -> None:
        self.session.close()

    def body(self, prompt: str, params: GenerationParams, stream: bool) -> dict:
        body = {"model": params.lora_name or self.model, "messages": [{"role": "user", "content": prompt}],
                "stream": stream, "max_tokens": params.max_tokens,
                "temperature": params.temperature if params.temperature is not None else 0.0}
        if stream:
            body["stream_options"] = {"include_usage": True}
        # --mix's sampled and penalised requests, and the speculation settings, under the API's (and vLLM's) names
        for key in ("top_p", "seed", "repetition_penalty", "presence_penalty", "num_draft_tokens",
                    "num_draft_branches", "draft_model"):
            value = getattr(params, key)
            if value is not None:
                body[key] = value
        if params.guide_type:
            body["structured_outputs"] = _STRUCTURED_OUTPUTS[params.guide_type](params.guide)
        return body

    @staticmethod
    def fields(chunk: dict) -> dict:
        """A streamed chunk's (or a whole answer's) text, counts and statistics, as the result builder takes them
        (empty: a chunk that carries no token, as the role chunk: TTFT stays honest)."""
        if "error" in chunk:
            raise classify_http_error(500, json.dumps({"error": chunk["error"]["message"]}))
        fields = dict(chunk.get("speculative_decoding") or {})
        choices = chunk.get("choices", [])  # a chat chunk's delta or a whole answer's message, or a completion's text
        content = "".join((c.get("delta") or c.get("message") or {}).get("content") or c.get("text") or ""
                          for c in choices)
        if content:
            fields[tn.TEXT_OUTPUT] = content
        if chunk.get("usage"):
            fields[tn.NUM_OUTPUT_TOKENS] = chunk["usage"]["completion_tokens"]
            fields[tn.NUM_INPUT_TOKENS] = chunk["usage"]["prompt_tokens"]
        return fields

    def send(self, builder: ResultBuilder, prompt: str, params: GenerationParams, stream: bool = True,
             cancel: bool = False) -> None:
        """One request into `builder`; with `cancel` the client leaves after the first chunk with a token (the
        connection closed mid-stream, as a user who stops reading)."""
        with self.session.post(f"{self.base}{self.path}", json=self.body(prompt, params, stream), stream=stream,
                               timeout=(10, 600)) as response:
            if response.status_code != 200:
                raise classify_http_error(response.status_code, response.text)
            if not stream:
                builder.add(self.fields(response.json()))
                return
            # lines end at "\n" alone (sse_lines): iter_lines(decode_unicode=True) would also cut at U+2028 and
            # the like, which JSON may hold raw
            for line in sse_lines(response.iter_content(chunk_size=STREAM_CHUNK)):
                if not line or not line.startswith("data:") or line == "data: [DONE]":
                    continue
                fields = self.fields(json.loads(line[len("data:"):]))
                if fields:
                    builder.add(fields)
                    if cancel and builder.first is not None:
                        return


class CompletionsApi(ChatApi):
    """Text completions (`/v1/completions`, what vLLM's benchmark_serving and most throughput tools send): the
    prompt as it is, no chat template."""

    path = "/completions"

    def body(self, prompt: str, params: GenerationParams, stream: bool) -> dict:
        body = super().body(prompt, params, stream)
        del body["messages"]
        body["prompt"] = prompt
        return body


class MessagesApi(ChatApi):
    """Anthropic's Messages API on the same port: the key as x-api-key; TTFT at the first text delta, the counts
    from message_start and message_delta (a whole answer's `usage`), acceptance from message_delta's (the
    answer's) `speculative_decoding` statistics."""

    path = "/messages"

    def __init__(self, base: str, model: str = ""):
        super().__init__(base, model)
        self.session.headers["anthropic-version"] = "2023-06-01"  # every Anthropic client sends it

    def authorize(self, key: str) -> None:
        self.session.headers["x-api-key"] = key

    def body(self, prompt: str, params: GenerationParams, stream: bool) -> dict:
        body = super().body(prompt, params, stream)
        body.pop("stream_options", None)
        return body

    @staticmethod
    def fields(chunk: dict) -> dict:
        kind = chunk.get("type")
        if kind == "error":
            raise classify_http_error(500, json.dumps({"error": chunk["error"]["message"]}))
        if kind == "content_block_delta" and chunk["delta"].get("text"):
            return {tn.TEXT_OUTPUT: chunk["delta"]["text"]}
        if kind in ("message_delta", "message"):  # the stream's last counts, or a whole answer
            text = "".join(block.get("text", "") for block in chunk.get("content") or [])
            return {**(chunk.get("speculative_decoding") or {}), **({tn.TEXT_OUTPUT: text} if text else {}),
                    tn.NUM_OUTPUT_TOKENS: chunk["usage"]["output_tokens"],
                    tn.NUM_INPUT_TOKENS: chunk["usage"]["input_tokens"]}
        return {}


class OpenAIUser(_SpecdecMixin, User):
    """Sends every request as an OpenAI chat completion (host: the API's base URL, http://host:9000/v1): streamed,
    or with --mix as GrpcStreamUser mixes them (streamed or whole, clients that leave mid-stream); see ChatApi."""

    request_type = "openai"
    api_class = ChatApi

    def on_start(self):
        super().on_start()
        self.api = self.api_class(self.host, getattr(self.environment.parsed_options, "openai_model", ""))

    def on_stop(self):
        self.api.close()

    @task
    def generate(self):
        self.through_api(self.api, *self.shape())


class OpenAICompletionsUser(OpenAIUser):
    """Sends every request as an OpenAI text completion (host: the API's base URL; name the class on the command
    line); see CompletionsApi."""

    request_type = "completions"
    api_class = CompletionsApi


class AnthropicUser(OpenAIUser):
    """Sends every request through Anthropic's Messages API (host: the API's base URL, http://host:9000/v1; name
    the class on the command line); see MessagesApi."""

    request_type = "anthropic"
    api_class = MessagesApi
