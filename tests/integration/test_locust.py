"""Locust headless with the standard command line against the tiny-pair server; reads its CSV statistics."""

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import tensor_names as tn
from specdec.serving.pairs import TINY_LORA

pytestmark = pytest.mark.integration

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


def run_locust(tmp_path, host, seconds=5, extra=()):
    prefix = tmp_path / "stats"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4",
             "-t", f"{seconds}s", "--stop-timeout", "30", "--host", host, "--csv", str(prefix),
             "--max-tokens", "24", *extra],
            capture_output=True, text=True, timeout=seconds + 90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"locust did not stop:\n{(exc.stdout or b'')[-3000:]}\n{(exc.stderr or b'')[-3000:]}")
    rows = list(csv.DictReader(open(f"{prefix}_stats.csv")))
    latency = {row["metric"]: row for row in csv.DictReader(open(f"{prefix}_specdec.csv"))}
    return out, {(row["Type"], row["Name"]): row for row in rows}, latency


@pytest.mark.parametrize("scheme", ["grpc", "http", "openai", "completions", "anthropic", "vllm"])
def test_locust_headless_records_requests_and_ttft(server, tmp_path, scheme):
    host = {"grpc": server.grpc_url, "http": server.http_url, "openai": server.openai_url,
            "completions": server.openai_url, "anthropic": server.openai_url, "vllm": server.grpc_url}[scheme]
    # gRPC, OpenAI and vLLM-backend users spread their requests over the session's LoRA adapter and the base model
    adapters = ["--lora-names", f"{TINY_LORA},"] if scheme in ("grpc", "openai", "completions", "vllm") else []
    user_class = {"anthropic": ["AnthropicUser"], "vllm": ["VllmBackendUser"],
                  "completions": ["OpenAICompletionsUser"]}.get(scheme, [])
    before = server.metric("specdec_lora_requests_total", lora_name=TINY_LORA)
    out, rows, latency = run_locust(tmp_path, host, extra=user_class + adapters)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (server.metric("specdec_lora_requests_total", lora_name=TINY_LORA) > before) == bool(adapters)
    generate = rows[(scheme, "generate")]
    assert int(generate["Request Count"]) > 0
    assert int(generate["Failure Count"]) == 0
    # Only requests are Locust entries: the aggregated request rate is the generate rate.
    assert set(rows) == {(scheme, "generate"), ("", "Aggregated")}
    assert rows[("", "Aggregated")]["Request Count"] == generate["Request Count"]
    assert int(latency["ttft_ms"]["count"]) > 0 and float(latency["ttft_ms"]["p50"]) > 0
    assert int(latency["itl_ms"]["count"]) > 0
    summary = out.stdout + out.stderr
    for line in ("TTFT p50/p90/p99", "ITL p50/p90", "output tokens/s", "mean acceptance"):
        assert line in summary
    # The summary counts every user class's requests (those finished in the stop timeout too, after the CSV);
    # finished ones have their tokens (vLLM's responses count their own: summed), 24 each unless an end token
    # came first
    requests_done = int(re.search(r"requests +(\d+)", summary).group(1))
    finished = int(latency["ttft_ms"]["count"])
    assert requests_done >= int(generate["Request Count"]) and requests_done >= finished, summary
    tokens = int(re.search(r"\((\d+) tokens in", summary).group(1))
    assert finished * 24 >= tokens > finished * 4, summary
    if scheme == "vllm":  # vLLM's outputs carry no acceptance (the others' may have none: a paused draft)
        assert "mean acceptance     n/a" in summary


def test_locust_sends_guided_requests(server, tmp_path):
    """--guided-fraction 1: every request carries a guide from the guides file. The project's file serves
    without a failure; a file whose guide does not compile fails every request (so the guides are sent)."""
    out, rows, _ = run_locust(tmp_path, server.grpc_url, seconds=6, extra=["--guided-fraction", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    generate = rows[("grpc", "generate")]
    assert int(generate["Request Count"]) > 0 and int(generate["Failure Count"]) == 0
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "Hi", "guide_type": "regex", "guide": "[0-9"}\n')
    out, rows, _ = run_locust(tmp_path, server.http_url, seconds=4,
                              extra=["--guided-fraction", "1", "--guides-file", str(broken)])
    generate = rows[("http", "generate")]
    assert int(generate["Request Count"]) > 0 and generate["Failure Count"] == generate["Request Count"]
    assert "guided_decoding_guide" in out.stdout + out.stderr


def test_locust_asks_for_the_draft_method_it_is_given(server, tmp_path):
    """--draft-model: every request names that method. A name the server does not offer fails every
    request, the error naming the input: the name is sent."""
    out, rows, _ = run_locust(tmp_path, server.http_url, seconds=4, extra=["--draft-model", "no_such_draft"])
    generate = rows[("http", "generate")]
    assert int(generate["Request Count"]) > 0 and generate["Failure Count"] == generate["Request Count"]
    assert "draft_model" in out.stdout + out.stderr


def test_locust_prepends_a_shared_system_prompt_that_the_server_caches(server, tmp_path):
    """--system-prompt-file: every prompt starts with the file's text; after the first requests the target
    finds it in its prefix cache (at least its first three blocks each time)."""
    before = server.metric("specdec_model_prefix_cache_hits_total", model="target_model")
    out, rows, _ = run_locust(tmp_path, server.grpc_url, seconds=6,
                              extra=["--system-prompt-file", str(LOCUSTFILE.parent / "system_prompt.txt")])
    assert out.returncode == 0, out.stderr[-3000:]
    generate = rows[("grpc", "generate")]
    count = int(generate["Request Count"])
    assert count >= 8 and int(generate["Failure Count"]) == 0
    found = server.metric("specdec_model_prefix_cache_hits_total", model="target_model") - before
    assert found >= 3 * 32 * (count - 4)  # the 4 users' first requests may run side by side, all new


def test_every_load_test_guide_compiles():
    import json

    from specdec.decoding.grammar import GuideCompiler
    from specdec.decoding.text import load_tokenizer
    from specdec.serving.pairs import smollm2_tokenizer_dir

    guides = GuideCompiler(load_tokenizer(str(smollm2_tokenizer_dir())))
    rows = [json.loads(line) for line in (LOCUSTFILE.parent / "guided.jsonl").read_text().splitlines() if line.strip()]
    assert {row["guide_type"] for row in rows} == {"json_schema", "choice", "regex", "structural_tag"}
    for row in rows:
        guide = row["guide"] if isinstance(row["guide"], str) else json.dumps(row["guide"])
        guides.compile(row["guide_type"], guide)


def test_locust_distributed_summary_counts_every_workers_requests(server, tmp_path):
    """--processes 2: a master and two workers; the master's summary has the workers' samples."""
    out, rows, latency = run_locust(tmp_path, server.grpc_url, extra=["--processes", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    generate = rows[("grpc", "generate")]
    requests_done = int(generate["Request Count"])
    assert requests_done > 0 and int(generate["Failure Count"]) == 0
    # Every finished request's TTFT reached the master (a request cut at the time limit has none).
    assert 0 < int(latency["ttft_ms"]["count"]) <= requests_done
    summary = out.stdout + out.stderr
    assert summary.count("speculative decoding load summary") == 1  # the master's, not one per worker
    assert f"requests            {requests_done}" in summary


def test_soak_reports_memory_over_time_against_a_running_server(server, tmp_path):
    """`make soak-mixed`'s script (mixed traffic, vllm_compatible's and the OpenAI API's clients among it), briefly,
    against the suite's server: no failures, every process's RSS (the API's too) at start and end split into
    anonymous and shared growth, and the largest grower's RSS over time."""
    script = LOCUSTFILE.parent / "soak.py"
    out = tmp_path / "soak.md"
    relayed = server.metric("nv_inference_request_success", model=tn.VLLM_COMPATIBLE)
    result = subprocess.run([sys.executable, str(script), "--grpc-url", server.grpc_url,
                             "--server-pid", str(server.process.pid), "--duration", "8", "--warmup", "2",
                             "--sample-every", "2", "--users", "3", "--max-tokens", "16", "--mix", "--out", str(out),
                             "--openai-url", server.openai_url, "--openai-fraction", "0.3"],
                            capture_output=True, text=True, timeout=240)
    # 1: grew >= 5 % (an 8 s run proves nothing), with its report written; a crash exits 1 too, without one.
    assert result.returncode in (0, 1) and out.exists(), result.stdout[-2000:] + result.stderr[-3000:]
    report = out.read_text()
    assert ", 0 failures" in report and "requests" in report
    table = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| ")}
    assert {"target_model", "speculative_decoding", "tritonserver", "openai api", "total"} <= set(table)
    assert "30% through the OpenAI API" in report
    assert int(re.search(r"requests \(.*openai (\d+)", report).group(1)) > 0  # its share was sent
    # One row per stub: the orchestrator's second instance has its own.
    assert "speculative_decoding #2" in table, sorted(table)
    assert server.metric("nv_inference_request_success", model=tn.VLLM_COMPATIBLE) > relayed  # its share was sent
    assert re.search(r"[+-]\d+ / [+-]\d+", table["target_model"])  # anonymous / shared growth
    series = re.search(r"RSS \(anonymous \+ shared, MiB\) every 2 s: ([\d, ]+)", report)
    assert series and len(series.group(1).split(",")) >= 3
