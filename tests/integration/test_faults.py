"""Faults on a server of its own (sequences idle for 2 s are evicted; draft_model holds one sequence):
a sequence abandoned without its release call is evicted by time, also while no other request arrives;
a draft model that fails mid-request (here: out of sequence slots) is bypassed, and the request finishes
on target-only rounds with the same greedy output; the memory of ended sequences goes back to the OS."""

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from specdec import tensor_names as tn
from specdec.serving import pairs, repository

from .helpers import grpc_stream, retire_server, start_server

pytestmark = pytest.mark.integration

IDLE_TIMEOUT_S = 2
HEAP_TRIM_S = 1


def step_inputs(ids: list[int], keep: int) -> list:
    inputs = [grpcclient.InferInput(tn.INPUT_IDS, [1, len(ids)], "INT32"),
              grpcclient.InferInput(tn.CACHE_LENGTH, [1, 1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([ids], dtype=np.int32))
    inputs[1].set_data_from_numpy(np.array([[keep]], dtype=np.int32))
    return inputs


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("faults")
    pair = dataclasses.replace(pairs.tiny_pair(), sequence_idle_timeout_s=IDLE_TIMEOUT_S)
    repo = repository.render(pair, tmp_path / "repo")
    repository.override(repo, "draft_model.max_sequences=1")
    repository.override(repo, f"target_model.heap_trim_interval_s={HEAP_TRIM_S}")
    repository.override(repo, f"speculative_decoding.heap_trim_interval_s={HEAP_TRIM_S}")
    server = start_server(tmp_path, repository=repo)
    yield server
    retire_server(server)  # nothing left in flight: exit code 0


def test_a_failing_draft_model_falls_back_to_target_only(srv):
    """Four concurrent requests share a draft model that holds one sequence: the others' draft calls fail
    ("too many live sequences"), their rounds run target-only, and every output equals target-only's."""
    prompts = ["Hello there, how are you today?", "Once upon a time, in a land far away,",
               "def fibonacci(n):", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
    solo = [grpc_stream(srv.grpc_url, p, max_tokens=24, num_draft_tokens=0)[tn.TEXT_OUTPUT] for p in prompts]
    before = srv.metric("specdec_draft_fallbacks_total", draft_model=tn.DRAFT_MODEL_NAME)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: grpc_stream(srv.grpc_url, p, max_tokens=24, num_draft_tokens=3,
                                                      draft_model=tn.DRAFT_MODEL_NAME, adaptive_draft=False),
                                prompts))
    assert [r[tn.TEXT_OUTPUT] for r in results] == solo
    assert all(r[tn.FINISH_REASON] == tn.FINISH_LENGTH for r in results)
    assert srv.metric("specdec_draft_fallbacks_total", draft_model=tn.DRAFT_MODEL_NAME) > before
    assert srv.metric("specdec_requests_total", finish_reason="error") == 0


def test_abandoned_sequences_are_evicted_by_time_without_other_requests(srv):
    time.sleep(1.5 * IDLE_TIMEOUT_S)  # what earlier tests left is gone
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    # Sequences start on target_model (two) and draft_model (its one slot), never released (no END flag).
    opened = [(tn.TARGET_MODEL_NAME, 101), (tn.TARGET_MODEL_NAME, 102), (tn.DRAFT_MODEL_NAME, 103)]
    try:
        for model, seq in opened:
            client.infer(model, step_inputs([5, 6, 7], 0), sequence_id=seq, sequence_start=True)
        assert srv.metric("specdec_model_live_sequences", model=tn.TARGET_MODEL_NAME) == 2
        assert srv.metric("specdec_model_kv_cache_bytes", model=tn.TARGET_MODEL_NAME) > 0
        # No request reaches the models from now on: only the eviction timer can free them.
        deadline = time.monotonic() + 6 * IDLE_TIMEOUT_S
        live = None
        while time.monotonic() < deadline:
            live = [srv.metric("specdec_model_live_sequences", model=m) for m in (tn.TARGET_MODEL_NAME, tn.DRAFT_MODEL_NAME)]
            if live == [0, 0]:
                break
            time.sleep(0.25)
        assert live == [0, 0]
        assert srv.metric("specdec_model_kv_cache_bytes", model=tn.TARGET_MODEL_NAME) == 0
        # The evicted sequence's next step is refused by name, and the server keeps serving.
        with pytest.raises(Exception, match="evicted after idling"):
            client.infer(tn.TARGET_MODEL_NAME, step_inputs([8], 3), sequence_id=101)
    finally:
        # Triton's sequence batcher holds the three slots until an END flag (the model's eviction does not
        # reach it), and shutdown would wait its full exit timeout on them as "in-flight inferences".
        for model, seq in opened:
            try:
                client.infer(model, step_inputs([8], 3), sequence_id=seq, sequence_end=True)
            except Exception:  # noqa: BLE001 - refused as evicted; the END flag still frees the slot
                pass
        client.close()


def test_ended_sequences_memory_is_trimmed_back_to_the_os(srv):
    """Once a sequence ends, target_model's evictor thread returns the freed heap within an interval or
    two, and so does the orchestrator's trimming thread once the request ended: their counters move; with
    nothing ended since, they stay."""
    models = (tn.TARGET_MODEL_NAME, tn.SPECULATIVE_DECODING)
    trims = lambda: [srv.metric("specdec_model_heap_trims_total", model=m) for m in models]  # noqa: E731
    time.sleep(3 * HEAP_TRIM_S)
    settled = trims()
    time.sleep(3 * HEAP_TRIM_S)
    assert trims() == settled  # nothing ended: no trim
    grpc_stream(srv.grpc_url, "Trim me afterwards", max_tokens=8, num_draft_tokens=0)
    deadline = time.monotonic() + 10 * HEAP_TRIM_S
    while any(now == before for now, before in zip(trims(), settled)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(now > before for now, before in zip(trims(), settled)), (settled, trims())
