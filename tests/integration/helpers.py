"""Starting a real tritonserver through the project's launcher, and calling the ensemble with plain tritonclient."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from client.sync import grpc_inputs

from specdec import tensor_names as tn
from specdec.serving import server as serving_server
from specdec.serving.healthcheck import answers, gateway_url
from specdec.serving.metrics_text import samples
from specdec.serving.server import ServerProcess as Server
from specdec.serving.server import free_ports

READY_TIMEOUT_S = 300


def stub_processes(run_dir: Path) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "triton_python_backend_stub" in line and str(run_dir) in line]


def stubs_left(run_dir: Path, wait_s: float = 30) -> list[str]:
    """The server's stub processes still running after up to wait_s (they exit just after tritonserver)."""
    deadline = time.monotonic() + wait_s
    while stub_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    return stub_processes(run_dir)


def uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def stub_crashes(pids: set[int], since_s: float) -> list[str]:
    """The kernel's log lines of segfaults of these processes since that uptime (the kernel logs a crashed
    process's signal; Triton does not when a stub dies after its model unloaded). Empty where the
    kernel log cannot be read (no permission, or no dmesg on the machine)."""
    try:
        result = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    crashes = []
    for line in result.stdout.splitlines():
        match = re.match(r"\[\s*([0-9.]+)\]\s+\S+\[(\d+)\]: segfault", line)
        if match and int(match.group(2)) in pids and float(match.group(1)) >= since_s - 1.0:
            crashes.append(line)
    return crashes


def start_server(tmp_dir: Path, pair: str = "tiny", repository: Path | None = None,
                 launcher_args: tuple[str, ...] = ()) -> Server:
    """A launcher-started tritonserver for a named pair, or for an already rendered repository."""
    source = [*(["--model-repository", str(repository)] if repository else ["--pair", pair]), *launcher_args]
    try:
        return serving_server.start(tmp_dir / f"run-{pair}", tmp_dir / f"tritonserver-{pair}.log", source,
                                    ready_timeout_s=READY_TIMEOUT_S)
    except serving_server.ServerStartError as exc:
        pytest.fail(f"tritonserver ({pair}) did not become ready: {exc}")


def busy(server: Server) -> dict[str, float]:
    """Models with pending requests and the orchestrator's live generations (empty when idle)."""
    text = server.metrics()
    return {f"{name}{labels}": value for name in ("nv_inference_pending_request_count", "specdec_live_sequences")
            for labels, value in samples(text, name) if value}


def stop_server(server: Server, require_clean_exit: bool = True) -> int:
    """Let the last (possibly client-abandoned) requests drain, then SIGTERM the launcher; it must stop
    tritonserver and every stub process, none of them crashing on the way out, and nothing may stay stuck
    in flight. Returns the exit code."""
    deadline = time.monotonic() + 60
    stubs, since = {int(line.split()[0]) for line in stub_processes(server.run_dir)}, uptime_s()
    try:
        while (pending := busy(server)) and time.monotonic() < deadline:
            time.sleep(0.5)
    except Exception:  # a server that no longer answers its metrics: stopped all the same
        server.stop(timeout_s=90)
        raise
    if pending:
        server.stop(timeout_s=90)
    assert not pending, f"requests still in flight 60 s after the last test: {pending}"
    code = server.stop(timeout_s=90)
    leftover = stubs_left(server.run_dir)
    assert not leftover, f"stub processes left after SIGTERM: {leftover}"
    crashes = stub_crashes(stubs, since)
    assert not crashes, f"stubs crashed on the way out: {crashes}"
    if require_clean_exit:
        assert code == 0, f"launcher exited with {code}:\n{server.log_path.read_text()[-3000:]}"
    return code


_RETIRING: list[tuple[Server, threading.Thread, list[BaseException]]] = []


def retire_server(server: Server, require_clean_exit: bool = True) -> None:
    """stop_server on a thread: a module's server winds down (Triton's unloading is a few seconds, mostly
    waiting) while the next module's tests run. `check_retired` (at the session's end) fails with whatever
    went wrong, naming the server's log."""
    errors: list[BaseException] = []

    def run():
        try:
            stop_server(server, require_clean_exit)
        except BaseException as exc:  # noqa: BLE001 - reported by check_retired
            errors.append(exc)
    thread = threading.Thread(target=run, name=f"retire {server.run_dir}", daemon=True)
    thread.start()
    _RETIRING.append((server, thread, errors))


def check_retired() -> None:
    failures = []
    for server, thread, errors in _RETIRING:
        thread.join(timeout=240)  # stop_server's own limits: 60 s of draining, 90 + 30 s of stopping
        if thread.is_alive():
            failures.append(f"{server.log_path}: still stopping after 240 s")
        failures += [f"{server.log_path}: {type(exc).__name__}: {exc}" for exc in errors]
    _RETIRING.clear()
    assert not failures, "\n".join(failures)


# ---- request helpers (plain tritonclient, the way any Triton LLM client calls the ensemble) ----------
def ensemble_inputs(prompt: str | None, **params) -> list:
    """The ensemble's inputs; prompt None leaves text_input out."""
    types = {tn.MAX_TOKENS: np.int32, tn.NUM_DRAFT_TOKENS: np.int32, tn.TEMPERATURE: np.float32,
             tn.TOP_K: np.int32, tn.TOP_P: np.float32, tn.SEED: np.uint64, tn.STREAM: np.bool_,
             tn.END_ID: np.int32, tn.ADAPTIVE_DRAFT: np.bool_, tn.NUM_DRAFT_BRANCHES: np.int32, tn.APPLY_CHAT_TEMPLATE: np.bool_,
             tn.MIN_LENGTH: np.int32, tn.IGNORE_EOS: np.bool_, tn.RETURN_LOG_PROBS: np.bool_,
             tn.RETURN_PERF_METRICS: np.bool_, tn.PRIORITY: np.int32}
    arrays = {} if prompt is None else {tn.TEXT_INPUT: np.array([[prompt.encode()]], dtype=np.object_)}
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
    client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(prompt, **{**params, "max_tokens": 900, "stream": True, "end_id": 0}))
    _, error = chunks.get(timeout=60)
    assert error is None, error
    client.stop_stream(cancel_requests=True)
    client.close()


OUTPUTS = [tn.TEXT_OUTPUT, tn.FINISH_REASON, tn.NUM_INPUT_TOKENS, tn.NUM_OUTPUT_TOKENS, tn.TOTAL_DRAFT_TOKENS,
           tn.TOTAL_ACCEPTED_DRAFT_TOKENS, tn.ACCEPTANCE_RATE, tn.NUM_ROUNDS, tn.MEAN_ACCEPTED_LENGTH, tn.NUM_CACHED_TOKENS,
           *tn.PERF_METRIC_OUTPUTS]  # with return_perf_metrics


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
    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status  # the gRPC status, e.g. "StatusCode.UNAVAILABLE", where the error carried one


def grpc_stream(url: str, prompt: str, timeout: float = 120, **params) -> dict:
    """One request over gRPC streaming (ModelStreamInfer). Returns the final outputs plus 'chunks',
    the text of every response in order, and 'chunk_ids', the tokens of each."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(prompt, **params), enable_empty_final_response=True)
        chunks, chunk_ids, final = [], [], {}
        deadline = time.monotonic() + timeout
        while True:
            result, error = responses.get(timeout=max(1, deadline - time.monotonic()))
            if error is not None:
                raise GenerationError(str(error), error.status() if hasattr(error, "status") else None)
            response = result.get_response()
            if response.outputs:
                decoded = _decode_result(result)
                chunks.append(decoded.get(tn.TEXT_OUTPUT, ""))
                ids = result.as_numpy(tn.OUTPUT_IDS)
                chunk_ids.append([] if ids is None else [int(i) for i in ids.reshape(-1)])
                final = decoded
            if response.parameters.get("triton_final_response") and response.parameters["triton_final_response"].bool_param:
                break
        final["chunks"], final["chunk_ids"] = chunks, chunk_ids
        final[tn.TEXT_OUTPUT] = "".join(chunks)
        return final
    finally:
        client.stop_stream()
        client.close()


def http_generate(base_url: str, prompt: str | None, timeout: float = 120, stream: bool = False, **params) -> dict:
    """Triton's generate extension: /generate (one JSON) or /generate_stream (SSE)."""
    body = {} if prompt is None else {tn.TEXT_INPUT: prompt}
    body.update({k: v for k, v in params.items() if v is not None})
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


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `bench/<script>` (as the module bench.<script>, from the repository's root) with this interpreter;
    fails the test, with its output's tail, if it fails."""
    import sys

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", f"bench.{script.removesuffix('.py')}", *args], capture_output=True,
                            text=True, timeout=timeout, cwd=root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@contextlib.contextmanager
def own_gateway(server, model, *args, env=None):
    """A gateway process of the test's own in front of the session's server (its flags `args`): its port."""
    port = free_ports(1)[0]
    process = subprocess.Popen([sys.executable, "-m", "specdec.gateway", "--port", str(port), "--grpc-url",
                                server.grpc_url, "--served-model-name", model, *args],
                               env={"PATH": "/usr/bin:/bin", **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while not answers(gateway_url(port), 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(30)
