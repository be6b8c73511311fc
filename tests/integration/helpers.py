"""Starting a real tritonserver through the project's launcher, and calling the ensemble with plain tritonclient."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from client.sync import grpc_inputs

from specdec import tensor_names as tn

READY_TIMEOUT_S = 300


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass
class Server:
    http_port: int
    grpc_port: int
    metrics_port: int
    run_dir: Path
    log_path: Path
    process: subprocess.Popen

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://localhost:{self.http_port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        """Sum of a Prometheus metric's samples whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False


def stub_processes(run_dir: Path) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "triton_python_backend_stub" in line and str(run_dir) in line]


def start_server(tmp_dir: Path, pair: str = "tiny", repository: Path | None = None) -> Server:
    """A launcher-started tritonserver for a named pair, or for an already rendered repository."""
    http, grpc, metrics = free_ports(3)
    run_dir = tmp_dir / f"run-{pair}"
    log_path = tmp_dir / f"tritonserver-{pair}.log"
    env = dict(os.environ, PAIR=pair, HTTP_PORT=str(http), GRPC_PORT=str(grpc), METRICS_PORT=str(metrics))
    log = open(log_path, "w")
    source = ["--model-repository", str(repository)] if repository else ["--pair", pair]
    process = subprocess.Popen([sys.executable, "-m", "specdec.launcher", *source, "--run-dir", str(run_dir)],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(http, grpc, metrics, run_dir, log_path, process)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not server.ready():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = log_path.read_text()[-4000:]
            pytest.fail(f"tritonserver ({pair}) did not become ready:\n{tail}")
        time.sleep(0.5)
    return server


def busy(server: Server) -> dict[str, float]:
    """Models with pending requests and the orchestrator's live generations (empty when idle)."""
    out = {}
    for line in server.metrics().splitlines():
        if line.startswith(("nv_inference_pending_request_count", "specdec_live_sequences")):
            name, value = line.rsplit(" ", 1)
            if float(value):
                out[name] = float(value)
    return out


def stop_server(server: Server, require_clean_exit: bool = True) -> int:
    """Let the last (possibly client-abandoned) requests drain, then SIGTERM the launcher; it must stop
    tritonserver and every stub process, and nothing may stay stuck in flight. Returns the exit code."""
    deadline = time.monotonic() + 60
    while (pending := busy(server)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not pending, f"requests still in flight 60 s after the last test: {pending}"
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=90)
    deadline = time.monotonic() + 30
    while stub_processes(server.run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    leftover = stub_processes(server.run_dir)
    assert not leftover, f"stub processes left after SIGTERM: {leftover}"
    if require_clean_exit:
        assert code == 0, f"launcher exited with {code}:\n{server.log_path.read_text()[-3000:]}"
    return code


# ---- request helpers (plain tritonclient, the way any Triton LLM client calls the ensemble) ----------
def _inputs(prompt: str, **params) -> list:
    types = {tn.MAX_TOKENS: np.int32, tn.NUM_DRAFT_TOKENS: np.int32, tn.TEMPERATURE: np.float32,
             tn.TOP_K: np.int32, tn.TOP_P: np.float32, tn.SEED: np.uint64, tn.STREAM: np.bool_,
             tn.END_ID: np.int32, tn.ADAPTIVE_DRAFT: np.bool_, tn.APPLY_CHAT_TEMPLATE: np.bool_}
    arrays = {tn.TEXT_INPUT: np.array([[prompt.encode()]], dtype=np.object_)}
    for name, value in params.items():
        if value is None:
            continue
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif name in types:
            arrays[name] = np.array([[value]], dtype=types[name])
        else:
            arrays[name] = np.array([[str(value).encode()]], dtype=np.object_)
    return grpc_inputs(arrays)


def open_stream_and_cancel(url: str, prompt: str, **params) -> None:
    """Start a long streaming request (900 tokens, no end token), wait for its first chunk, cancel it."""
    client = grpcclient.InferenceServerClient(url)
    chunks: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: chunks.put((result, error)))
    client.async_stream_infer(tn.ENSEMBLE, _inputs(prompt, **{**params, "max_tokens": 900, "stream": True, "end_id": 0}))
    _, error = chunks.get(timeout=60)
    assert error is None, error
    client.stop_stream(cancel_requests=True)
    client.close()


OUTPUTS = [tn.TEXT_OUTPUT, tn.FINISH_REASON, tn.NUM_INPUT_TOKENS, tn.NUM_OUTPUT_TOKENS, tn.TOTAL_DRAFT_TOKENS,
           tn.TOTAL_ACCEPTED_DRAFT_TOKENS, tn.ACCEPTANCE_RATE, tn.NUM_ROUNDS, tn.MEAN_ACCEPTED_LENGTH]


def _decode_result(result) -> dict:
    out = {}
    for name in OUTPUTS:
        value = result.as_numpy(name)
        if value is None:
            continue
        item = value.reshape(-1)[0] if value.size else b""
        out[name] = item.decode() if isinstance(item, bytes) else item.item()
    return out


class GenerationError(Exception):
    pass


def grpc_stream(url: str, prompt: str, timeout: float = 120, **params) -> dict:
    """One request over gRPC streaming (ModelStreamInfer). Returns the final outputs plus 'chunks',
    the text of every response in order."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(tn.ENSEMBLE, _inputs(prompt, **params), enable_empty_final_response=True)
        chunks, final = [], {}
        deadline = time.monotonic() + timeout
        while True:
            result, error = responses.get(timeout=max(1, deadline - time.monotonic()))
            if error is not None:
                raise GenerationError(str(error))
            response = result.get_response()
            if response.outputs:
                decoded = _decode_result(result)
                chunks.append(decoded.get(tn.TEXT_OUTPUT, ""))
                final = decoded
            if response.parameters.get("triton_final_response") and response.parameters["triton_final_response"].bool_param:
                break
        final["chunks"] = chunks
        final[tn.TEXT_OUTPUT] = "".join(chunks)
        return final
    finally:
        client.stop_stream()
        client.close()


def http_generate(base_url: str, prompt: str, timeout: float = 120, stream: bool = False, **params) -> dict:
    """Triton's generate extension: /generate (one JSON) or /generate_stream (SSE)."""
    body = {tn.TEXT_INPUT: prompt, **{k: v for k, v in params.items() if v is not None}}
    if stream:
        body[tn.STREAM] = True
    path = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"{base_url}/v2/models/{tn.ENSEMBLE}/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read().decode()
    except urllib.error.HTTPError as exc:
        raise GenerationError(exc.read().decode()) from None
    if not stream:
        return json.loads(raw)
    events = [json.loads(line[len("data:"):]) for line in raw.splitlines() if line.startswith("data:")]
    errors = [e for e in events if "error" in e]
    if errors:
        raise GenerationError(errors[0]["error"])
    final = dict(events[-1])
    final["chunks"] = [e.get(tn.TEXT_OUTPUT, "") for e in events]
    final[tn.TEXT_OUTPUT] = "".join(final["chunks"])
    return final
