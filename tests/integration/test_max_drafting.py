"""A server of its own with one orchestrator instance and `max_drafting_sequences` at 1: a request drafts
while it generates alone; while another one generates, every round of both is target-only, with the same
greedy text. A seeded sampled request keeps drafting: its text must not depend on the load. And `make
bench-suffix`'s script against it and a reset of the caches (one instance: one suffix cache sees every
request)."""

import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.serving import server

from .helpers import grpc_stream, retire_server

pytestmark = pytest.mark.integration

DRAFTED = dict(num_draft_tokens=3, adaptive_draft=False)  # without the limit: 3 tokens every round (room allowing)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("max-drafting")
    own = server.start(tmp_path / "run", tmp_path / "server.log",
                       ["--pair", "tiny", "--orchestrator-instances", "1",
                        "--set", "speculative_decoding.max_drafting_sequences=1"])
    yield own
    retire_server(own)  # nothing in flight, no stub left, exit code 0


def test_rounds_are_target_only_while_more_requests_generate_than_the_limit(limited):
    prompt = "Once upon a time, in a land far away,"
    alone = grpc_stream(limited.grpc_url, prompt, max_tokens=24, **DRAFTED)
    assert alone[tn.TOTAL_DRAFT_TOKENS] > 0
    limited_rounds = lambda: limited.metric("specdec_load_limited_rounds_total")  # noqa: E731
    assert limited_rounds() == 0
    seeded = dict(max_tokens=24, temperature=1.0, seed=7, **DRAFTED)
    seeded_alone = grpc_stream(limited.grpc_url, prompt, **seeded)

    started, long = threading.Event(), []
    params = GenerationParams(max_tokens=600, ignore_eos=True, **DRAFTED)
    worker = threading.Thread(target=lambda: long.append(Client(limited.grpc_url, timeout_s=300).generate(
        "Hello there, how are you today?", params, stream=True, on_text=lambda _delta: started.set())))
    worker.start()
    assert started.wait(timeout=120)
    beside = grpc_stream(limited.grpc_url, prompt, max_tokens=24, **DRAFTED)
    seeded_beside = grpc_stream(limited.grpc_url, prompt, **seeded)
    assert worker.is_alive()  # the long one generated all along
    worker.join(timeout=300)
    assert beside[tn.TEXT_OUTPUT] == alone[tn.TEXT_OUTPUT]
    assert beside[tn.TOTAL_DRAFT_TOKENS] == 0 and beside[tn.NUM_ROUNDS] == beside[tn.NUM_OUTPUT_TOKENS]
    assert limited_rounds() >= beside[tn.NUM_ROUNDS]  # its rounds, and the long one's beside it
    assert seeded_beside[tn.TEXT_OUTPUT] == seeded_alone[tn.TEXT_OUTPUT]
    assert seeded_beside[tn.TOTAL_DRAFT_TOKENS] == seeded_alone[tn.TOTAL_DRAFT_TOKENS] > 0
    (result,) = long
    assert result.num_output_tokens == 600 and result.total_draft_tokens > 0  # it drafted while alone


def test_suffix_bench_drafts_the_second_pass_from_the_first(limited, tmp_path):
    """`bench/suffix_bench.py` (`make bench-suffix`) on this server: every row, the text equal to target-only's
    (greedy), and the repeated workload's second pass drafted from the first one's answers (more tokens per
    round). One request at a time: the limit never holds."""
    out = tmp_path / "suffix.md"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "bench.suffix_bench", "--url", limited.grpc_url, "--pair", "tiny", "--prompts", "2",
                             "--max-tokens", "16", "--out", str(out)], capture_output=True, text=True, timeout=600,
                            cwd=root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = [line for line in out.read_text().splitlines()
             if line.startswith("| ") and not line.startswith(("| workload", "| ---"))]
    rows = {(cells[0], cells[1]): cells for cells in ([cell.strip() for cell in line.split("|")[1:-1]] for line in lines)}
    assert len(rows) == 7 and all(cells[-1] == "100%" for cells in rows.values())
    first, second = rows["repeated", "suffix, adaptive K<=16"], rows["repeated", "suffix, adaptive K<=16, second pass"]
    assert float(second[5]) > float(first[5]) and float(second[4]) > 0.5, (first, second)


def test_a_cache_reset_forgets_earlier_requests_text_for_the_suffix_draft(limited):
    """SGLang's /flush_cache on this server's API empties the suffix cache: a prompt sent again is drafted from
    its first answer (more accepted, fewer rounds); sent after a reset, it is drafted exactly as on its first
    send after the reset before it, with the same greedy text."""
    prompt = "The lighthouse keeper counted the ships that passed the point before dawn"
    params = dict(max_tokens=24, num_draft_tokens=8, draft_model="suffix", adaptive_draft=False)
    flush = lambda: urllib.request.urlopen(urllib.request.Request(  # noqa: E731
        limited.openai_url.removesuffix("/v1") + "/flush_cache", data=b"", method="POST"), timeout=30).status
    figures = lambda r: (r[tn.TEXT_OUTPUT], r[tn.TOTAL_ACCEPTED_DRAFT_TOKENS], r[tn.NUM_ROUNDS])  # noqa: E731
    assert flush() == 200
    first = grpc_stream(limited.grpc_url, prompt, **params)
    again = grpc_stream(limited.grpc_url, prompt, **params)
    assert again[tn.TEXT_OUTPUT] == first[tn.TEXT_OUTPUT]
    assert again[tn.TOTAL_ACCEPTED_DRAFT_TOKENS] > first[tn.TOTAL_ACCEPTED_DRAFT_TOKENS], (first, again)
    assert flush() == 200
    assert figures(grpc_stream(limited.grpc_url, prompt, **params)) == figures(first)
