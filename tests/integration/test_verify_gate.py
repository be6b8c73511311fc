"""The verify gate on a server of its own (`verify_gather_ms` 1000, far above a round here): concurrent
streams' verify calls leave together, so target_model's forwards carry all of them, the outputs stay
each request's solo target-only output, and a single stream never waits.

One orchestrator instance: the gate is each instance's, and with two the streams' split between them
(and how long they overlap) decided how many rounds could wait; under a CPU-bound neighbour 16-token
requests hardly overlapped (15 holds in 64 rounds, once)."""

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import tensor_names as tn
from specdec.serving import pairs, repository

from .helpers import grpc_stream, retire_server, start_server

pytestmark = pytest.mark.integration

WINDOW_MS = 1000
TOKENS = 32
PROMPTS = ["Hello there, how are you today?", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gate")
    repo = repository.render(dataclasses.replace(pairs.tiny_pair(), orchestrator_instances=1), tmp_path / "repo")
    repository.override(repo, f"speculative_decoding.verify_gather_ms={WINDOW_MS}")
    server = start_server(tmp_path, repository=repo)
    yield server
    retire_server(server)


@pytest.mark.parametrize("k", [0, 3])
def test_concurrent_streams_wait_for_each_other_and_keep_their_outputs(gated, k):
    params = dict(max_tokens=TOKENS, num_draft_tokens=k, draft_model=tn.DRAFT_MODEL_NAME, adaptive_draft=False,
                  ignore_eos=True)
    holds = lambda: gated.metric("specdec_verify_gate_holds_total")  # noqa: E731
    before, started = holds(), time.monotonic()
    solo = [grpc_stream(gated.grpc_url, p, **params) for p in PROMPTS]
    # One at a time nobody waits: had 8 of these rounds waited out the window, this took 8 s.
    assert time.monotonic() - started < 8 * WINDOW_MS / 1e3
    assert holds() == before
    metric = lambda name: gated.metric(name, model=tn.TARGET_MODEL_NAME)  # noqa: E731
    steps, execs = metric("nv_inference_request_success"), metric("nv_inference_exec_count")
    rounds = gated.metric("specdec_rounds_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: grpc_stream(gated.grpc_url, p, **params), PROMPTS))
    assert [r[tn.TEXT_OUTPUT] for r in together] == [r[tn.TEXT_OUTPUT] for r in solo]
    # Rounds' verifies waited for the others' (at best all but the last to arrive; 0 without the gate).
    rounds = gated.metric("specdec_rounds_total") - rounds
    assert holds() - before >= rounds / 4, (holds() - before, rounds)
    # And target_model ran fewer forwards than it answered steps (how many fewer depends on how far apart
    # the BLS calls reach it).
    assert metric("nv_inference_exec_count") - execs < metric("nv_inference_request_success") - steps
