"""pipelined_execute and run_ahead served by a real tritonserver: draft_model and target_model return from
execute once their forward is done and answer through their requests' senders from a thread of their own
(responder.py), on the static executor (what GPUs run; eager on CPU), and target_model runs each greedy
target-only step's successor ahead (engine/run_ahead.py, on as on a GPU). Concurrent mixed requests, two
of them cancelled mid-stream, each equal their solo target-only output token for token; target-only text
equals a draft model's (no step run ahead there); a head's rounds that draft nothing run ahead too; a step
asked for after one ran ahead gets its own answer; every cache is freed and the server stops cleanly (the
responder threads too)."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from specdec import tensor_names as tn
from specdec.serving import pairs, server

from .helpers import grpc_stream, http_generate, open_stream_and_cancel, retire_server

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there, how are you today?", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "Speculative decoding drafts tokens with a small model and"]
CANCELLED = {3, 8}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pipelined")
    pair = pairs.tiny_pair()
    args = ["--target", pair.target_path, "--draft", pair.draft_paths["draft_model"], "--tokenizer", pair.tokenizer_path]
    for model in ("target_model", "draft_model"):
        args += ["--set", f"{model}.pipelined_execute=true", "--set", f"{model}.executor=static",
                 "--set", f"{model}.kv_pool_tokens=8192"]
    args += ["--set", "target_model.run_ahead=on"]
    # A random EAGLE-3 head: its requests want the target's features every round, drafting or not
    args += ["--draft-head", f"head={_random_head(tmp_path / 'head')}", "--set", "head.draft_stop_below=0"]
    own = server.start(tmp_path / "run", tmp_path / "server.log", args)
    yield own
    retire_server(own)  # nothing in flight, no stub left, exit code 0


def _random_head(path):
    from transformers import AutoConfig

    from specdec.engine.draft_heads import EAGLE3, random_head, save_head

    config = AutoConfig.from_pretrained(pairs.tiny_pair().target_path)
    return save_head(random_head(EAGLE3, config, aux_layers=(0, 1, 1)), path)


def case(i):
    return dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=10 + 5 * (i % 3), num_draft_tokens=(0, 2, 4, 6)[i % 4],
                draft_model=("draft_model", "ngram")[i % 2], stream=bool(i % 2), adaptive_draft=i % 3 == 0)


def test_concurrent_requests_equal_their_solo_outputs_and_free_their_caches(pipelined):
    cases = [case(i) for i in range(10)]
    solo = {i: grpc_stream(pipelined.grpc_url, c["prompt"], max_tokens=c["max_tokens"], num_draft_tokens=0)
            for i, c in enumerate(cases) if i not in CANCELLED}

    def one(i):
        params = {k: v for k, v in cases[i].items() if k != "prompt"}
        if i in CANCELLED:
            return open_stream_and_cancel(pipelined.grpc_url, cases[i]["prompt"], **params)
        return grpc_stream(pipelined.grpc_url, cases[i]["prompt"], **params)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, range(len(cases))))
    drafted = 0
    for i, result in enumerate(results):
        if i in CANCELLED:
            continue
        assert result[tn.TEXT_OUTPUT] == solo[i][tn.TEXT_OUTPUT], cases[i]
        assert result[tn.NUM_OUTPUT_TOKENS] == solo[i][tn.NUM_OUTPUT_TOKENS] == cases[i]["max_tokens"] or \
            result[tn.FINISH_REASON] == "stop"
        drafted += result[tn.TOTAL_DRAFT_TOKENS]
    assert drafted > 0  # the draft model and prompt lookup really proposed
    # Sampled with a draft model (its distributions through the pipeline too), over HTTP: seeded, it repeats.
    sampled = [http_generate(pipelined.http_url, PROMPTS[1], max_tokens=12, num_draft_tokens=3, temperature=0.9,
                             seed=7)[tn.TEXT_OUTPUT] for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = [pipelined.metric("specdec_live_sequences"), pipelined.metric("specdec_model_live_sequences", model="draft_model"),
                pipelined.metric("specdec_model_live_sequences", model="target_model")]
        if live == [0, 0, 0]:
            break
        time.sleep(0.5)
    assert live == [0, 0, 0]
    log = pipelined.log_path.read_text()
    assert "target_model: pipelined execute" in log and "draft_model: pipelined execute" in log


def test_bad_steps_get_their_errors_through_the_sender_and_the_model_keeps_serving(pipelined):
    """target_model called directly: each bad step's error, named, reaches its caller through the sender;
    a good step and its sequence's release beside them still work."""
    client = grpcclient.InferenceServerClient(pipelined.grpc_url)

    def step(ids, keep, num_logits=1, release=False):
        inputs = [grpcclient.InferInput(tn.INPUT_IDS, [1, len(ids)], "INT32"),
                  grpcclient.InferInput(tn.CACHE_LENGTH, [1, 1], "INT32"),
                  grpcclient.InferInput(tn.NUM_LOGITS, [1, 1], "INT32"),
                  grpcclient.InferInput(tn.RELEASE, [1, 1], "BOOL")]
        for tensor, value in zip(inputs, ([ids], [[keep]], [[num_logits]], [[release]])):
            tensor.set_data_from_numpy(np.array(value, dtype=np.bool_ if tensor.name() == tn.RELEASE else np.int32))
        return inputs
    try:
        with pytest.raises(InferenceServerException, match="target_model: .*no cache"):
            # (start and end at once: a sequence left open counts as in flight until Triton's idle timeout)
            client.infer(tn.TARGET_MODEL_NAME, step([8], 3), sequence_id=901, sequence_start=True, sequence_end=True)
        with pytest.raises(InferenceServerException, match="target_model: num_logits=5 must be within"):
            client.infer(tn.TARGET_MODEL_NAME, step([5, 6], 0, num_logits=5), sequence_id=902, sequence_start=True,
                         sequence_end=True)
        good = client.infer(tn.TARGET_MODEL_NAME, step([5, 6, 7], 0, num_logits=2), sequence_id=903,
                            sequence_start=True)
        assert good.as_numpy(tn.GREEDY_TOKENS).shape == (1, 2)
        assert pipelined.metric("specdec_model_live_sequences", model=tn.TARGET_MODEL_NAME) >= 1
        client.infer(tn.TARGET_MODEL_NAME, step([], 0, num_logits=0, release=True), sequence_id=903, sequence_end=True)
        deadline = time.monotonic() + 5
        while pipelined.metric("specdec_model_live_sequences", model=tn.TARGET_MODEL_NAME) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pipelined.metric("specdec_model_live_sequences", model=tn.TARGET_MODEL_NAME) == 0
    finally:
        client.close()


def test_target_only_steps_run_ahead_and_equal_a_draft_models_text(pipelined):
    ahead = lambda outcome: pipelined.metric("specdec_model_run_ahead_steps_total",  # noqa: E731
                                             model=tn.TARGET_MODEL_NAME, outcome=outcome)
    used = ahead("used")
    plain = grpc_stream(pipelined.grpc_url, PROMPTS[4], max_tokens=24, num_draft_tokens=0)
    drafted = grpc_stream(pipelined.grpc_url, PROMPTS[4], max_tokens=24, num_draft_tokens=4, adaptive_draft=False,
                          draft_model="draft_model")
    assert plain[tn.TEXT_OUTPUT] == drafted[tn.TEXT_OUTPUT] and drafted[tn.TOTAL_DRAFT_TOKENS] > 0
    # Every target-only round after the second took the step run ahead (the metrics flush at a release)
    deadline = time.monotonic() + 10
    while ahead("used") - used < plain[tn.NUM_OUTPUT_TOKENS] - 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ahead("used") - used >= plain[tn.NUM_OUTPUT_TOKENS] - 3


def test_a_heads_rounds_that_draft_nothing_run_ahead_and_keep_its_text(pipelined):
    """A head's request at K=0 asks for the target's features every round (to draft from later): its steps
    run ahead as a plain target-only request's do, and its text and a drafting one's equal target-only."""
    ahead = lambda: pipelined.metric("specdec_model_run_ahead_steps_total",  # noqa: E731
                                     model=tn.TARGET_MODEL_NAME, outcome="used")
    plain = grpc_stream(pipelined.grpc_url, PROMPTS[1], max_tokens=24, num_draft_tokens=0, ignore_eos=True)
    used = ahead()
    paused = grpc_stream(pipelined.grpc_url, PROMPTS[1], max_tokens=24, num_draft_tokens=0, draft_model="head",
                         ignore_eos=True)
    drafted = grpc_stream(pipelined.grpc_url, PROMPTS[1], max_tokens=24, num_draft_tokens=3, adaptive_draft=False,
                          draft_model="head", ignore_eos=True)
    assert plain[tn.TEXT_OUTPUT] == paused[tn.TEXT_OUTPUT] == drafted[tn.TEXT_OUTPUT]
    assert paused[tn.TOTAL_DRAFT_TOKENS] == 0 and drafted[tn.TOTAL_DRAFT_TOKENS] > 0
    deadline = time.monotonic() + 10
    while ahead() - used < paused[tn.NUM_OUTPUT_TOKENS] - 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ahead() - used >= paused[tn.NUM_OUTPUT_TOKENS] - 3


def test_a_step_after_one_ran_ahead_gets_its_own_answer(pipelined):
    """target_model called directly: a one-token step runs its successor ahead; asking for another token
    instead (a rollback of it) answers what a fresh sequence with that text answers."""
    client = grpcclient.InferenceServerClient(pipelined.grpc_url)

    def greedy(seq_id, ids, keep, start=False, end=False):
        inputs = [grpcclient.InferInput(tn.INPUT_IDS, [1, len(ids)], "INT32"),
                  grpcclient.InferInput(tn.CACHE_LENGTH, [1, 1], "INT32"),
                  grpcclient.InferInput(tn.NUM_LOGITS, [1, 1], "INT32"),
                  grpcclient.InferInput(tn.RELEASE, [1, 1], "BOOL")]
        for tensor, value in zip(inputs, ([ids], [[keep]], [[int(bool(ids))]], [[end and not ids]])):
            tensor.set_data_from_numpy(np.array(value, dtype=np.bool_ if tensor.name() == tn.RELEASE else np.int32))
        outputs = [grpcclient.InferRequestedOutput(tn.GREEDY_TOKENS)]
        result = client.infer(tn.TARGET_MODEL_NAME, inputs, outputs=outputs, sequence_id=seq_id,
                              sequence_start=start, sequence_end=end)
        return int(result.as_numpy(tn.GREEDY_TOKENS).reshape(-1)[-1]) if ids else None
    dropped = pipelined.metric("specdec_model_run_ahead_steps_total", model=tn.TARGET_MODEL_NAME, outcome="dropped")
    try:
        first = greedy(911, [5, 6, 7], 0, start=True)
        second = greedy(911, [first], 3)  # its successor (second) runs ahead now
        other = (second + 1) % 50
        answer = greedy(911, [other], 4)  # not the step run ahead: dropped, this one runs
        assert answer == greedy(912, [5, 6, 7, first, other], 0, start=True, end=True)
        greedy(911, [], 0, end=True)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while (pipelined.metric("specdec_model_run_ahead_steps_total", model=tn.TARGET_MODEL_NAME, outcome="dropped")
           == dropped and time.monotonic() < deadline):
        time.sleep(0.2)
    assert pipelined.metric("specdec_model_run_ahead_steps_total", model=tn.TARGET_MODEL_NAME,
                            outcome="dropped") > dropped
