"""What the OpenAI API costs (`make bench-openai`): the same streamed requests through the gateway and
straight to the ensemble over gRPC, interleaved in one run against one server; and through
`vllm_compatible` (vLLM's backend's clients' form: [1]-shaped tensors over tritonclient's gRPC asyncio
stream, relayed to the ensemble by a Python stub). The launcher's gateway calls preprocessing and then
speculative_decoding itself (`--upstream direct`); a second gateway process in front of the same server calls the
ensemble (`--upstream ensemble`), the same bare client's requests to both side by side.

Serves the tiny pair (or `--pair default`; `--pair 8b --device gpu`: gpu_bench's synthetic 8B-shaped pair, `--pair
small` its CPU twin), sends each prompt both ways at a fixed K, greedy, one request at
a time (and with --concurrency N, N at once), and prints per path: time to first token and the gap between
consecutive chunks (p50/p99), their difference to the direct path at the median, and the gateway process's
CPU time per streamed chunk and per output token (Linux /proc). Every client runs in this process on one
asyncio loop: the direct one is client/aio.py's (tritonclient gRPC asyncio); through the gateway, the official
`openai` SDK's AsyncOpenAI and a bare aiohttp client (what the gateway costs without the SDK's own work),
each a streamed completion (text in, as the direct request sends it). And a chat through the two chat-shaped
APIs, from the bare client: OpenAI's chat completions and Anthropic's Messages API, the same conversation (so
the same prompt, its chat template applied), compared with each other (their prompt is not the direct path's).

    python -m bench.openai_gateway_bench                      # tiny pair, 1 and 4 streams
    python -m bench.openai_gateway_bench --results openai-gateway
    python -m bench.openai_gateway_bench --pair 8b --device gpu --requests 8 --max-tokens 128   # a GPU's machinery
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import openai
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import np_to_triton_dtype

from bench import report
from bench.round_overhead import PAIRS, served_pair
from client import GenerationParams
from client.aio import AsyncClient
from specdec import tensor_names as tn
from specdec.serving import server as serving
from specdec.serving.healthcheck import answers, gateway_url

HERE = Path(__file__).resolve().parent


def prompts(n: int) -> list[str]:
    rows = [json.loads(line)["prompt"] for name in ("prompts_open.jsonl", "prompts_grounded.jsonl")
            for line in (HERE / name).read_text().splitlines() if line.strip()]
    return [rows[i % len(rows)] for i in range(n)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_pid(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"specdec.gateway --port {port} "], capture_output=True, text=True).stdout
    return int(out.split()[0])


def stub_pid(run_dir: Path, instance: str) -> int:
    """The Python-backend stub process of a model instance of the server in run_dir."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return next(int(line.split()[0]) for line in out.splitlines()
                if "triton_python_backend_stub" in line and str(run_dir) in line and f" {instance} " in f"{line} ")


async def direct(client: AsyncClient, prompt: str, params: GenerationParams) -> tuple[float, list[float], int]:
    """(TTFT, gaps between chunks, output tokens) of one streamed request straight to the ensemble."""
    stamps: list[float] = []
    sent = time.perf_counter()
    result = await client.generate(prompt, params, stream=True, on_text=lambda _text: stamps.append(time.perf_counter()))
    return stamps[0] - sent, [b - a for a, b in zip(stamps, stamps[1:])], result.num_output_tokens


async def through_gateway(client: openai.AsyncOpenAI, model: str, prompt: str, params: GenerationParams):
    stamps: list[float] = []
    tokens = 0
    sent = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=params.max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"num_draft_tokens": params.num_draft_tokens,
                                                         "adaptive_draft": False, "ignore_eos": params.ignore_eos})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return stamps[0] - sent, [b - a for a, b in zip(stamps, stamps[1:])], tokens


async def through_raw(session: aiohttp.ClientSession, url: str, model: str, prompt: str, params: GenerationParams):
    """The same request from a bare aiohttp client: the gateway's cost without the SDK's own."""
    stamps: list[float] = []
    tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "num_draft_tokens": params.num_draft_tokens,
            "adaptive_draft": False, "ignore_eos": params.ignore_eos}  # (as the direct request: an instruct model
    # may end a bare prompt at once)
    sent = time.perf_counter()
    async with session.post(f"{url}/completions", json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return stamps[0] - sent, [b - a for a, b in zip(stamps, stamps[1:])], tokens


async def through_chat_api(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                           params: GenerationParams, anthropic: bool):
    """The prompt as a user message, streamed by OpenAI's chat completions or Anthropic's Messages API (a bare
    client: what each API's own streaming costs in the gateway)."""
    stamps: list[float] = []
    tokens = 0
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": params.max_tokens,
            "temperature": 0, "stream": True, "num_draft_tokens": params.num_draft_tokens, "adaptive_draft": False,
            "ignore_eos": True}
    if not anthropic:
        body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    async with session.post(f"{url}/messages" if anthropic else f"{url}/chat/completions", json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if anthropic:
                if chunk["type"] == "content_block_delta":
                    stamps.append(time.perf_counter())
                elif chunk["type"] == "message_delta":
                    tokens = chunk["usage"]["output_tokens"]
            else:
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return stamps[0] - sent, [b - a for a, b in zip(stamps, stamps[1:])], tokens


async def through_vllm_compatible(client: grpcaio.InferenceServerClient, prompt: str, params: GenerationParams):
    """The same request as vLLM's backend's clients send it, to vllm_compatible."""
    settings = {"max_tokens": params.max_tokens, "temperature": 0, "ignore_eos": True}
    arrays = {tn.TEXT_INPUT: np.array([prompt.encode()], dtype=np.object_), tn.STREAM: np.array([True]),
              tn.SAMPLING_PARAMETERS: np.array([json.dumps(settings).encode()], dtype=np.object_),
              tn.EXCLUDE_INPUT_IN_OUTPUT: np.array([True]), tn.RETURN_NUM_OUTPUT_TOKENS: np.array([True]),
              # this server's own: K fixed, as on the other paths
              tn.NUM_DRAFT_TOKENS: np.array([params.num_draft_tokens], dtype=np.int32),
              tn.ADAPTIVE_DRAFT: np.array([False])}
    inputs = []
    for name, array in arrays.items():
        inputs.append(grpcaio.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
        inputs[-1].set_data_from_numpy(array)

    async def one():
        yield {"model_name": tn.VLLM_COMPATIBLE, "inputs": inputs}
    stamps: list[float] = []
    tokens = 0
    sent = time.perf_counter()
    done = False
    # Read to the stream's end: leaving it after the last response leaks the request in Triton 24.10 (api.md).
    async for result, error in client.stream_infer(inputs_iterator=one()):
        if error is not None:
            raise RuntimeError(str(error))
        if done:
            continue
        stamps.append(time.perf_counter())
        tokens += int(result.as_numpy(tn.NUM_OUTPUT_TOKENS)[0])
        done = result.as_numpy(tn.TEXT_OUTPUT) is not None and tokens >= params.max_tokens
    return stamps[0] - sent, [b - a for a, b in zip(stamps, stamps[1:])], tokens


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ensemble_gateway(srv, model: str) -> tuple[subprocess.Popen, str]:
    """A gateway process of its own in front of `srv` calling its ensemble (`--upstream ensemble`): (it, its URL)."""
    port = serving.free_ports(1)[0]
    process = subprocess.Popen([sys.executable, "-m", "specdec.gateway", "--port", str(port), "--upstream",
                                "ensemble", "--grpc-url", srv.grpc_url, "--served-model-name", model],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while not answers(gateway_url(port), 2):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError(f"the --upstream ensemble gateway on port {port} did not come up")
        time.sleep(0.2)
    return process, url


async def run(srv, texts: list[str], params: GenerationParams, concurrency: int,
              via_ensemble: tuple[subprocess.Popen, str]) -> dict:
    grpc_client = AsyncClient(srv.grpc_url, timeout_s=600)
    api = openai.AsyncOpenAI(base_url=srv.openai_url, api_key="unused", max_retries=0, timeout=600)
    model = (await api.models.list()).data[0].id
    session = aiohttp.ClientSession()
    vllm_client = grpcaio.InferenceServerClient(srv.grpc_url)
    # each front door's own process: the gateway, vllm_compatible's stub
    gateway, relay = gateway_pid(srv.openai_port), stub_pid(srv.run_dir, f"{tn.VLLM_COMPATIBLE}_0_0")
    second, ensemble_url = via_ensemble[0].pid, via_ensemble[1]
    calls = {"direct": lambda p: direct(grpc_client, p, params),
             "gateway, openai SDK": lambda p: through_gateway(api, model, p, params),
             "gateway, aiohttp client": lambda p: through_raw(session, srv.openai_url, model, p, params),
             "gateway --upstream ensemble, aiohttp client": lambda p: through_raw(session, ensemble_url, model, p,
                                                                                  params),
             "gateway, chat completions (aiohttp)":
                 lambda p: through_chat_api(session, srv.openai_url, model, p, params, anthropic=False),
             "gateway, Anthropic messages (aiohttp)":
                 lambda p: through_chat_api(session, srv.openai_url, model, p, params, anthropic=True),
             "vllm_compatible": lambda p: through_vllm_compatible(vllm_client, p, params)}
    pids = {path: relay if path == "vllm_compatible" else second if "--upstream ensemble" in path else gateway
            for path in calls}
    out = {path: {"ttft": [], "gaps": [], "tokens": 0, "cpu": 0.0, "wall": 0.0} for path in calls}
    for call in calls.values():  # warm every path
        await call(texts[0])
    order = list(calls)
    for start in range(0, len(texts), concurrency):
        batch = texts[start:start + concurrency]
        order = order[1:] + order[:1]  # each path first in turn: drift spreads over all
        for path in order:
            before, started = cpu_seconds(pids[path]), time.perf_counter()
            results = await asyncio.gather(*[calls[path](p) for p in batch])
            out[path]["wall"] += time.perf_counter() - started
            out[path]["cpu"] += cpu_seconds(pids[path]) - before
            for ttft, gaps, tokens in results:
                out[path]["ttft"].append(ttft)
                out[path]["gaps"] += gaps
                out[path]["tokens"] += tokens
    await grpc_client.close()
    await vllm_client.close()
    await api.close()
    await session.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny", choices=PAIRS)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args()
    try:
        label, pair_args = served_pair(args.pair, args.device)
    except ValueError as exc:
        parser.error(str(exc))
    # No chat template: the completions endpoint takes the text as it is (the default pair's text_input would
    # take one), so both paths send the same prompt
    params = GenerationParams(max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, adaptive_draft=False,
                              temperature=0.0, ignore_eos=True, apply_chat_template=False)
    work = Path(tempfile.mkdtemp(prefix="openai-bench-"))
    srv = serving.start(work / "run", work / "server.log",
                        [*pair_args, *(["--device", "gpu"] if args.device == "gpu" else [])])
    rows = []
    second = None
    try:
        model = openai.OpenAI(base_url=srv.openai_url, api_key="unused").models.list().data[0].id
        second = ensemble_gateway(srv, model)
        for concurrency in args.concurrency:
            measured = asyncio.run(run(srv, prompts(args.requests), params, concurrency, second))
            d = measured["direct"]
            for path, m in measured.items():
                chunks = len(m["gaps"]) + len(m["ttft"])
                gateway = path != "direct"
                same_prompt = gateway and "(aiohttp)" not in path  # the chat APIs' prompt has the template's tokens
                rows.append([concurrency, "gRPC stream to ensemble" if path == "direct" else path,
                             f"{m['tokens'] / m['wall']:.1f}",
                             f"{pct(m['ttft'], 50) * 1e3:.1f}", f"{pct(m['ttft'], 99) * 1e3:.1f}",
                             f"{pct(m['gaps'], 50) * 1e3:.2f}", f"{pct(m['gaps'], 99) * 1e3:.2f}", f"{m['tokens']}",
                             f"{(statistics.median(m['ttft']) - statistics.median(d['ttft'])) * 1e3:+.1f}"
                             if same_prompt else "",
                             f"{(statistics.median(m['gaps']) - statistics.median(d['gaps'])) * 1e3:+.2f}" if gateway else "",
                             f"{m['cpu'] / chunks * 1e6:.0f}" if gateway else "",
                             f"{m['cpu'] / m['tokens'] * 1e6:.0f}" if gateway else ""])
    finally:
        if second is not None:
            second[0].terminate()
            second[0].wait(30)
        srv.stop()
    header = (f"OpenAI API and vllm_compatible against gRPC streaming to the ensemble, {label}, "
              f"{args.requests} requests per path and concurrency, {args.max_tokens} tokens each, "
              f"K={args.num_draft_tokens} fixed, greedy "
              f"({report.machine()})")
    text = report.print_table(header, rows, ["streams", "path", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                                             "chunk gap p50 ms",
                                             "chunk gap p99 ms", "output tokens", "TTFT over gRPC (median) ms",
                                             "gap over gRPC (median) ms", "front door's CPU µs/chunk",
                                             "front door's CPU µs/token"], args.out)
    if args.results:
        report.write_results(args.results, "The OpenAI API's own cost: `make bench-openai`", text)


if __name__ == "__main__":
    main()
