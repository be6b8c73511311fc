"""The full generation API through `ensemble` on a real tritonserver: streaming, sampling, stop words,
metrics, cancellation, validation and concurrency."""

import dataclasses
import json
import queue
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from specdec import tensor_names as tn

from client import Client, GenerationParams
from client.sync import grpc_inputs

from .helpers import GenerationError, ensemble_inputs, grpc_stream, http_generate, open_stream_and_cancel

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there, how are you today?", "Once upon a time, in a land far away,",
           "Summarize: the quick brown fox jumps over the lazy dog.", "emoji 🚀🎉 and 中文 text:"]


# ---- streaming --------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 4])
def test_grpc_stream_deltas_equal_non_streamed_text(server, k):
    for prompt in PROMPTS:
        whole = grpc_stream(server.grpc_url, prompt, max_tokens=40, num_draft_tokens=k)
        streamed = grpc_stream(server.grpc_url, prompt, max_tokens=40, num_draft_tokens=k, stream=True)
        assert streamed[tn.TEXT_OUTPUT] == whole[tn.TEXT_OUTPUT]
        assert len(streamed["chunks"]) > 1  # it really streamed
        assert all("\ufffd" not in chunk for chunk in streamed["chunks"][:-1])
        assert streamed[tn.NUM_OUTPUT_TOKENS] == whole[tn.NUM_OUTPUT_TOKENS]


def test_a_stream_interval_spaces_the_responses_and_keeps_the_text(server):
    """sampling_parameters' stream_interval_ms: the rounds between two responses go together in the next,
    so fewer responses carry the same text (a stop word's cut included), none of them cut inside a character."""
    prompt = PROMPTS[3]
    every = grpc_stream(server.grpc_url, prompt, max_tokens=60, num_draft_tokens=2, stream=True, end_id=0)
    text = every[tn.TEXT_OUTPUT]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for settings, expected in (({}, text), ({"stop": stop}, text[:text.index(stop)])):
        one_by_one = grpc_stream(server.grpc_url, prompt, max_tokens=60, num_draft_tokens=2, stream=True, end_id=0,
                                 sampling_parameters=json.dumps(settings))
        spaced = grpc_stream(server.grpc_url, prompt, max_tokens=60, num_draft_tokens=2, stream=True, end_id=0,
                             sampling_parameters=json.dumps({**settings, "stream_interval_ms": 150}))
        assert spaced[tn.TEXT_OUTPUT] == one_by_one[tn.TEXT_OUTPUT] == expected
        assert spaced[tn.FINISH_REASON] == one_by_one[tn.FINISH_REASON]
        assert spaced[tn.NUM_OUTPUT_TOKENS] == one_by_one[tn.NUM_OUTPUT_TOKENS]
        assert 1 <= len([c for c in spaced["chunks"] if c]) < len([c for c in one_by_one["chunks"] if c]) / 2
        # no response but the last ends in a broken character (the model's own invalid bytes may sit inside)
        assert not any(chunk.endswith("\ufffd") for chunk in spaced["chunks"][:-1])


def test_skip_special_tokens_false_keeps_them_in_the_text_streamed_or_not(server, hf_target):
    """vLLM's skip_special_tokens false (what a tool-call parser reading a model's [TOOL_CALLS] needs): a
    special token the answer holds (here one forced by logit_bias; not an end token) shows in the text,
    whole and streamed, over gRPC and HTTP; by default it is left out."""
    tokenizer = hf_target[1]
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert special in tokenizer.all_special_ids and special != tokenizer.eos_token_id
    bias = {"logit_bias": {str(special): 100}, "max_tokens": 5}
    for stream in (False, True):
        kept = grpc_stream(server.grpc_url, PROMPTS[0], num_draft_tokens=2, stream=stream,
                           sampling_parameters=json.dumps({**bias, "skip_special_tokens": False}))
        assert kept[tn.TEXT_OUTPUT] == "<|im_start|>" * 5 and kept[tn.NUM_OUTPUT_TOKENS] == 5, stream
        left_out = grpc_stream(server.grpc_url, PROMPTS[0], num_draft_tokens=2, stream=stream,
                               sampling_parameters=json.dumps(bias))
        assert left_out[tn.TEXT_OUTPUT] == "" and left_out[tn.NUM_OUTPUT_TOKENS] == 5, stream
    over_http = http_generate(server.http_url, PROMPTS[0], stream=True, num_draft_tokens=2,
                              sampling_parameters=json.dumps({**bias, "skip_special_tokens": False}))
    assert over_http[tn.TEXT_OUTPUT] == "<|im_start|>" * 5
    # a stop string may then be a special token's text: the answer ends before it
    stopped = grpc_stream(server.grpc_url, PROMPTS[0], num_draft_tokens=2, sampling_parameters=json.dumps(
        {"max_tokens": 5, "logit_bias": {str(special): 100}, "skip_special_tokens": False, "stop": "<|im_start|>"}))
    assert stopped[tn.TEXT_OUTPUT] == "" and stopped[tn.FINISH_REASON] == "stop"


def test_http_generate_stream_sse_equals_generate(server):
    prompt = PROMPTS[1]
    whole = http_generate(server.http_url, prompt, max_tokens=30, num_draft_tokens=3)
    streamed = http_generate(server.http_url, prompt, stream=True, max_tokens=30, num_draft_tokens=3)
    assert streamed[tn.TEXT_OUTPUT] == whole[tn.TEXT_OUTPUT]
    assert len(streamed["chunks"]) > 1
    assert streamed[tn.FINISH_REASON] == whole[tn.FINISH_REASON]


# ---- sampling -------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_seed_matters(server):
    # a fixed K: the adaptive rule pauses a draft that does not pay for its measured costs (the tiny pair's)
    params = dict(max_tokens=30, num_draft_tokens=4, adaptive_draft=False, temperature=1.0, top_k=50, top_p=0.95)
    a = grpc_stream(server.grpc_url, PROMPTS[0], seed=1234, **params)
    b = grpc_stream(server.grpc_url, PROMPTS[0], seed=1234, **params)
    c = grpc_stream(server.grpc_url, PROMPTS[0], seed=99, **params)
    assert a[tn.TEXT_OUTPUT] == b[tn.TEXT_OUTPUT]
    assert a[tn.TEXT_OUTPUT] != c[tn.TEXT_OUTPUT]
    assert a[tn.TOTAL_DRAFT_TOKENS] > 0


def test_top_k_1_sampling_equals_greedy(server):
    greedy = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=30, num_draft_tokens=3)
    top1 = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=30, num_draft_tokens=3, temperature=0.7, top_k=1, seed=5)
    assert top1[tn.TEXT_OUTPUT] == greedy[tn.TEXT_OUTPUT]


def test_sampling_with_exact_draft_accepts_everything(server):
    result = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=30, num_draft_tokens=4, temperature=0.8,
                         seed=3, draft_model="draft_model_exact")
    assert result[tn.ACCEPTANCE_RATE] == 1.0


# ---- stop conditions --------------------------------------------------------------------------------
def test_stop_word_ends_text_before_it_streamed_or_not(server):
    full = grpc_stream(server.grpc_url, PROMPTS[1], max_tokens=60, num_draft_tokens=4)[tn.TEXT_OUTPUT]
    stop = full[len(full) // 2: len(full) // 2 + 3]  # three characters from the middle
    assert len(stop) == 3 and stop in full
    expected = full[:full.index(stop)]
    stop_words = np.array([[b"zzz-never", stop.encode()]], dtype=np.object_)
    for stream in (False, True):
        result = grpc_stream(server.grpc_url, PROMPTS[1], max_tokens=60, num_draft_tokens=4, stream=stream,
                             stop_words=stop_words)
        assert result[tn.TEXT_OUTPUT] == expected
        assert result[tn.FINISH_REASON] == tn.FINISH_STOP


def test_max_tokens_is_exact_and_reports_length(server):
    for k in (0, 3, 8):
        result = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=7, num_draft_tokens=k, end_id=0)
        assert result[tn.NUM_OUTPUT_TOKENS] == 7
        assert result[tn.FINISH_REASON] == tn.FINISH_LENGTH


def _rendered_parameter(server, model, key):
    """A parameter of the repository the server serves: the one it was given, or the launcher's rendering."""
    args = list(server.process.args)
    repo = (Path(args[args.index("--model-repository") + 1]) if "--model-repository" in args
            else server.run_dir / "model_repository")
    cfg = (repo / model / "config.pbtxt").read_text()
    return re.search(r'key: "' + key + r'", value: \{ string_value: "([^"]*)"', cfg).group(1)


@pytest.fixture(scope="module")
def hf_target(server):
    """The served target in transformers, in process (float64): an independent reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _rendered_parameter(server, "target_model", "model_path")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def hf_greedy(hf_target):
    """Plain transformers greedy decoding of the served target."""
    model, tokenizer = hf_target

    def run(prompt, n):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        return new, tokenizer.decode(new, skip_special_tokens=True)

    return run


def test_served_greedy_equals_transformers_generate(server, hf_greedy):
    for prompt in PROMPTS:
        _, text = hf_greedy(prompt, 16)
        for k in (0, 4):
            result = grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=k, end_id=0)
            assert result[tn.TEXT_OUTPUT] == text, (prompt, k)


def test_end_id_stops_generation(server, hf_greedy):
    """Take the 5th greedy token as end_id: generation stops right before its first occurrence."""
    ids, _ = hf_greedy(PROMPTS[3], 12)
    end = ids[4]
    first = ids.index(end)
    for k in (0, 2):
        result = grpc_stream(server.grpc_url, PROMPTS[3], max_tokens=12, num_draft_tokens=k, end_id=end)
        assert result[tn.FINISH_REASON] == tn.FINISH_STOP
        assert result[tn.NUM_OUTPUT_TOKENS] == first


def test_benchmark_clients_can_force_the_output_length(server, hf_greedy):
    """min_length (TensorRT-LLM's convention) and ignore_eos (vLLM's): an end token before min_length is
    generated like any other; with ignore_eos generation runs to max_tokens."""
    ids, _ = hf_greedy(PROMPTS[3], 12)
    end = ids[0]  # the very first greedy token: without either input, nothing is generated
    later = [i for i, token in enumerate(ids) if token == end and i >= 3]
    for k in (0, 2):
        assert grpc_stream(server.grpc_url, PROMPTS[3], max_tokens=12, num_draft_tokens=k,
                           end_id=end)[tn.NUM_OUTPUT_TOKENS] == 0
        forced = grpc_stream(server.grpc_url, PROMPTS[3], max_tokens=12, num_draft_tokens=k, end_id=end,
                             ignore_eos=True)
        assert forced[tn.NUM_OUTPUT_TOKENS] == 12 and forced[tn.FINISH_REASON] == tn.FINISH_LENGTH
        at_least = grpc_stream(server.grpc_url, PROMPTS[3], max_tokens=12, num_draft_tokens=k, end_id=end,
                               min_length=3)
        assert at_least[tn.NUM_OUTPUT_TOKENS] == (later[0] if later else 12)
    body = http_generate(server.http_url, PROMPTS[3], max_tokens=12, end_id=end, ignore_eos=True)
    assert body[tn.NUM_OUTPUT_TOKENS] == 12
    # min_tokens: the same setting by the name of TensorRT-LLM's current ensemble, vLLM and aiperf.
    body = http_generate(server.http_url, PROMPTS[3], max_tokens=12, end_id=end, min_tokens=3)
    assert body[tn.NUM_OUTPUT_TOKENS] == at_least[tn.NUM_OUTPUT_TOKENS]


# ---- observability ------------------------------------------------------------------------------------
def test_metrics_count_drafted_and_accepted_tokens(server):
    before_drafted = server.metric("specdec_draft_tokens_total")
    before_accepted = server.metric("specdec_accepted_draft_tokens_total")
    before_requests = server.metric("specdec_requests_total")
    result = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=20, num_draft_tokens=3)
    assert server.metric("specdec_draft_tokens_total") - before_drafted == result[tn.TOTAL_DRAFT_TOKENS]
    assert server.metric("specdec_accepted_draft_tokens_total") - before_accepted == result[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]
    assert server.metric("specdec_requests_total") - before_requests == 1
    text = server.metrics()
    for name in ("specdec_accepted_length_bucket", "specdec_accepted_at_position_total",
                 "specdec_drafted_at_position_total", "specdec_time_to_first_token_seconds_count",
                 "specdec_request_latency_seconds_count", "specdec_live_sequences"):
        assert name in text, name
    assert server.metric("specdec_accepted_at_position_total", position="1") <= \
        server.metric("specdec_drafted_at_position_total", position="1")


def test_cost_model_gauges_come_from_the_targets_forward_reports(server):
    """target_model reports each forward (rows, sequences, seconds); the orchestrator's policy turns them
    into v(k), published as gauges: at least one sequence per forward, and v(k) >= 1 (a round that
    verifies more positions never costs less than a target-only step). Each orchestrator instance
    publishes its own policy's gauges, labelled with the instance."""
    import time as clock

    from specdec.serving.metrics_text import samples

    prior = pytest.approx([1.1, 1.2, 1.4])  # v(k) = 1 + 0.1·k before anything is measured
    for _ in range(8):  # until an instance has measured and published (which instance Triton picks varies)
        grpc_stream(server.grpc_url, PROMPTS[1], max_tokens=24, num_draft_tokens=4)
        clock.sleep(0.6)  # the gauges are published at most twice a second, from a round
        grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=8, num_draft_tokens=4)
        text = server.metrics()
        by_instance: dict[str, dict[int, float]] = {}
        for labels, value in samples(text, "specdec_verify_cost"):
            by_instance.setdefault(labels["instance"], {})[int(labels["draft_tokens"])] = value
        # An instance that has run no round yet has published nothing (0).
        costs = [[gauges[k] for k in (1, 2, 4)] for gauges in by_instance.values() if any(gauges.values())]
        if any(instance != prior for instance in costs):
            break
    assert len(by_instance) == tn.DEFAULT_ORCHESTRATOR_INSTANCES["cpu"], by_instance
    assert max(value for _, value in samples(text, "specdec_sequences_per_forward")) >= 1.0
    # v(k) is clamped at 1, so ">= 1" alone proves nothing: the gauges must also have left the prior,
    # i.e. come from measured costs.
    assert costs and all(v >= 1.0 for instance in costs for v in instance), costs
    assert any(instance != prior for instance in costs), costs


# ---- cancellation ---------------------------------------------------------------------------------------
def test_cancelled_streams_free_their_caches(server):
    cancelled_before = server.metric("specdec_requests_total", finish_reason="cancelled")
    with ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda i: open_stream_and_cancel(server.grpc_url, PROMPTS[i % 4], num_draft_tokens=2), range(20)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = [server.metric("specdec_live_sequences"),
                server.metric("specdec_model_live_sequences", model="draft_model"),
                server.metric("specdec_model_live_sequences", model="target_model")]
        if live == [0, 0, 0]:
            break
        time.sleep(0.5)
    assert live == [0, 0, 0]
    # Generation stopped early (900 tokens each would take far longer than this test ran).
    assert server.metric("specdec_requests_total", finish_reason="cancelled") - cancelled_before == 20
    ok = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=20, num_draft_tokens=4)
    again = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=20, num_draft_tokens=0)
    assert ok[tn.TEXT_OUTPUT] == again[tn.TEXT_OUTPUT]


def _settled(server) -> tuple[float, float, float]:
    """(rounds, target tokens, draft tokens) counters once no sequence is live and the counters are flushed."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
            server.metric(name, **labels) for name, labels in (("specdec_live_sequences", {}),
                                                               ("specdec_model_live_sequences", {}))):
        time.sleep(0.2)
    time.sleep(1.2)  # the model counters are flushed at least every 0.5 s and when a sequence ends
    return (server.metric("specdec_rounds_total"),
            server.metric("specdec_model_tokens_processed_total", model="target_model"),
            server.metric("specdec_model_tokens_processed_total", model="draft_model"))


@pytest.mark.parametrize("k", [0, 4])
def test_a_cancelled_stream_costs_at_most_one_round_more(server, k):
    """A cancelled stream stops within a round. Through `ensemble` the orchestrator learns of the
    cancellation when its next response reaches postprocessing (Triton cancels only steps it schedules
    later), so beyond the rounds the client saw, the target may run: one finished and on its way (the
    client cannot tell it apart), the one in flight, and, with K=0, one started before the flag was up;
    with K>0 the check between draft and verify stops that one before the target runs it.
    Fixed K and no end token make the target's tokens exact: the prompt and what each round drafted, and
    after the first round one token more each (the previous round's own)."""
    rounds0, target0, draft0 = _settled(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    chunks: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: chunks.put((result, error)))
    client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(PROMPTS[1], max_tokens=900, stream=True, end_id=0,
                                                   num_draft_tokens=k, adaptive_draft=False))
    seen = 0
    while seen < 6:
        result, error = chunks.get(timeout=60)
        assert error is None, error
        seen = int(result.as_numpy(tn.NUM_ROUNDS).reshape(-1)[0])
        prompt = int(result.as_numpy(tn.NUM_INPUT_TOKENS).reshape(-1)[0])
        drafted = int(result.as_numpy(tn.TOTAL_DRAFT_TOKENS).reshape(-1)[0])  # up to K a round (confidence stop)
    client.stop_stream(cancel_requests=True)
    client.close()
    rounds1, target1, draft1 = _settled(server)
    rounds = rounds1 - rounds0
    target_seen = prompt + drafted + (seen - 1)  # each round after the first also runs the last one's token
    extra_target = target1 - target0 - target_seen
    print(f"K={k}: the client saw {seen} rounds; the server ran {rounds:.0f}; the target processed "
          f"{extra_target:.0f} tokens after the rounds seen, the draft {draft1 - draft0:.0f} in all")
    most = 2 if k else 3
    assert rounds - seen <= most, (rounds, seen)
    assert 0 <= extra_target <= most * (k + 1)
    # The draft: at most K+1 tokens per round (catch-up + K-1 drafted), one more round's draft than the
    # target (drafting when the cancellation arrived), the prompt in the first.
    assert draft1 - draft0 <= (prompt + k - 1 + (seen + 2) * (k + 1) if k else 0)
    assert server.metric("specdec_live_sequences") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_cancelled_direct_stream_stops_and_frees_its_caches(server, stream):
    """A client calling `speculative_decoding` itself (token ids in, no ensemble) and cancelling: Triton
    flags that request, and the orchestrator's check sees it (no postprocessing step raises the board's
    flag here): with every streamed response, or every CANCEL_POLL_S when it sends one at the end."""
    cancelled_before = server.metric("specdec_requests_total", finish_reason="cancelled")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    chunks: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: chunks.put((result, error)))
    inputs = grpc_inputs({tn.INPUT_IDS: np.array([[1, 400, 2000, 37, 912]], dtype=np.int32),
                          tn.MAX_TOKENS: np.array([[900]], dtype=np.int32),
                          tn.NUM_DRAFT_TOKENS: np.array([[2]], dtype=np.int32),
                          tn.STREAM: np.array([[stream]]), tn.IGNORE_EOS: np.array([[True]])})
    started = server.metric("specdec_rounds_total")
    client.async_stream_infer(tn.SPECULATIVE_DECODING, inputs)
    if stream:
        for _ in range(3):
            _, error = chunks.get(timeout=60)
            assert error is None, error
    else:  # nothing comes back before the end: cancel once rounds run
        deadline = time.monotonic() + 60
        while server.metric("specdec_rounds_total") == started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert chunks.empty()
    client.stop_stream(cancel_requests=True)
    client.close()
    rounds0, _, _ = _settled(server)  # a stream left running would keep a live sequence: _settled waits it out
    assert server.metric("specdec_requests_total", finish_reason="cancelled") - cancelled_before == 1
    assert server.metric("specdec_live_sequences") == 0
    time.sleep(1.0)
    assert server.metric("specdec_rounds_total") == rounds0  # nothing runs on


# ---- log-probabilities ----------------------------------------------------------------------------------
def _reference_log_probs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The target's log-probability of each output token, from one transformers forward over both."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits, -1)[torch.arange(len(output_ids)), torch.tensor(output_ids)]


def _direct_with_log_probs(server, prompt_ids: list[int], top: int = 3, **params
                           ) -> tuple[list[int], list[float], float, list[list[int]], list[list[float]]]:
    """`speculative_decoding` called with token ids, streamed, return_log_probs on (and num_top_log_probs
    `top`): every response's output_ids, output_log_probs and top rows in order, and the last cum_log_probs."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    arrays = {tn.INPUT_IDS: np.array([prompt_ids], dtype=np.int32), tn.STREAM: np.array([[True]]),
              tn.IGNORE_EOS: np.array([[True]]), tn.RETURN_LOG_PROBS: np.array([[True]]),
              tn.ADAPTIVE_DRAFT: np.array([[False]]), tn.NUM_TOP_LOG_PROBS: np.array([[top]], dtype=np.int32)}
    types = {tn.MAX_TOKENS: np.int32, tn.NUM_DRAFT_TOKENS: np.int32, tn.TEMPERATURE: np.float32, tn.SEED: np.uint64}
    arrays.update({name: np.array([[value]], dtype=types[name]) for name, value in params.items() if name in types})
    if tn.DRAFT_MODEL in params:
        arrays[tn.DRAFT_MODEL] = np.array([[params[tn.DRAFT_MODEL].encode()]], dtype=np.object_)
    ids, log_probs, cum, top_ids, top_values = [], [], None, [], []
    try:
        client.async_stream_infer(tn.SPECULATIVE_DECODING, grpc_inputs(arrays), enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            if result.get_response().outputs:
                ids += result.as_numpy(tn.OUTPUT_IDS).reshape(-1).tolist()
                log_probs += result.as_numpy(tn.OUTPUT_LOG_PROBS).reshape(-1).tolist()
                cum = float(result.as_numpy(tn.CUM_LOG_PROBS).reshape(-1)[0])
                top_ids += result.as_numpy(tn.OUTPUT_TOP_IDS)[0].tolist()
                top_values += result.as_numpy(tn.OUTPUT_TOP_LOG_PROBS)[0].tolist()
            final = result.get_response().parameters.get("triton_final_response")
            if final and final.bool_param:
                return ids, log_probs, cum, top_ids, top_values
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("k,temperature,draft", [
    (0, 0.0, "draft_model"), (4, 0.0, "draft_model"), (4, 1.0, "draft_model"), (3, 1.0, "draft_model_random")])
def test_log_probs_are_the_targets_for_every_token(server, hf_target, k, temperature, draft):
    """Greedy rounds send the target's greedy log-probabilities, sampled rounds compute them from the
    logits, accepted draft tokens and corrections alike: each equals transformers' log-softmax of the
    target at that position (the raw distribution: temperature does not enter); so do each position's three
    most likely tokens (num_top_log_probs), sent by the target in greedy rounds, taken from the logits in
    sampled ones."""
    model, tokenizer = hf_target
    prompt_ids = tokenizer(PROMPTS[1]).input_ids
    ids, log_probs, cum, top_ids, top_values = _direct_with_log_probs(
        server, prompt_ids, max_tokens=40, num_draft_tokens=k, temperature=temperature, seed=7, draft_model=draft)
    assert len(ids) == len(log_probs) == 40
    reference = _reference_log_probs(model, prompt_ids, ids)
    assert torch.allclose(torch.tensor(log_probs, dtype=torch.float64), reference, atol=1e-4), (log_probs, reference)
    assert cum == pytest.approx(sum(log_probs), abs=1e-3)
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1], -1)
    top_ids, top_values = torch.tensor(top_ids), torch.tensor(top_values, dtype=torch.float64)
    assert top_ids.shape == (40, 3)
    assert torch.allclose(rows.gather(1, top_ids).double(), top_values, atol=1e-4)  # each id's own
    assert torch.allclose(rows.topk(3).values.double(), top_values, atol=1e-4)  # the three most likely


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_ensemble_log_probs_streamed_or_not_over_grpc_and_http(server, hf_target, hf_greedy, protocol):
    model, tokenizer = hf_target
    new, _ = hf_greedy(PROMPTS[0], 16)
    reference = _reference_log_probs(model, tokenizer(PROMPTS[0]).input_ids, new)
    client = Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    for k in (0, 4):
        for stream in (False, True):
            result = client.generate(PROMPTS[0], GenerationParams(max_tokens=16, num_draft_tokens=k, end_id=0,
                                                                  return_log_probs=True, num_top_log_probs=2),
                                     stream=stream)
            assert torch.allclose(torch.tensor(result.log_probs, dtype=torch.float64), reference, atol=1e-4), (k, stream)
            # greedy: a position's most likely token is the one generated
            assert [row[0] for row in result.top_ids] == new and all(len(row) == 2 for row in result.top_ids)
            assert np.allclose([row[0] for row in result.top_log_probs], result.log_probs, atol=1e-6)
            assert all(row[0] >= row[1] for row in result.top_log_probs)
            assert result.cum_log_probs == pytest.approx(float(reference.sum()), abs=1e-3)
            if stream:
                assert len(result.chunks) > 1
    plain = client.generate(PROMPTS[0], GenerationParams(max_tokens=16, end_id=0))
    assert plain.log_probs == [] and plain.cum_log_probs == 0.0 and plain.top_ids == []  # not asked for: not sent


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_prompt_log_probs_score_every_prompt_token(server, hf_target, protocol):
    """return_prompt_log_probs: the prompt's tokens and each one's log-probability given those before it (and
    with num_top_log_probs its position's most likely tokens), equal to transformers' log-softmax of the
    target; computed whole although the prefix cache holds the prompt (served once before), with a draft
    verified in the same round or not, greedy or sampled, and the generation unchanged by asking."""
    model, tokenizer = hf_target
    prompt = PROMPTS[2]
    prompt_ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, :-1], -1)  # (P - 1, V)
    reference = rows[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    client = Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    for k, temperature, stream in ((0, 0.0, False), (4, 0.0, True), (4, 1.0, False), (3, 1.0, True)):
        params = GenerationParams(max_tokens=12, num_draft_tokens=k, temperature=temperature, seed=3, end_id=0,
                                  apply_chat_template=False)
        plain = client.generate(prompt, params, stream=stream)  # also puts the prompt in the prefix cache
        scored = client.generate(prompt, dataclasses.replace(params, return_prompt_log_probs=True, return_log_probs=True,
                                                              num_top_log_probs=2), stream=stream)
        assert scored.prompt_ids == prompt_ids and len(scored.prompt_log_probs) == len(prompt_ids) - 1
        assert torch.allclose(torch.tensor(scored.prompt_log_probs, dtype=torch.float64), reference, atol=1e-4), k
        top_ids = torch.tensor(scored.prompt_top_ids)
        assert top_ids.shape == (len(prompt_ids) - 1, 2)
        assert torch.allclose(rows.gather(1, top_ids), torch.tensor(scored.prompt_top_log_probs, dtype=torch.float64),
                              atol=1e-4)
        assert torch.equal(top_ids[:, 0], rows.argmax(-1))
        assert scored.text == plain.text and plain.prompt_ids == [] and plain.prompt_log_probs == []


# ---- bad words and TensorRT-LLM's client inputs ---------------------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_words_match_transformers_bad_words_ids(server, hf_target, hf_greedy, protocol):
    """Banned words, named as text the way a client names them, give transformers' greedy generate with
    `bad_words_ids` (an independent implementation of the same rule), target-only and speculative."""
    model, tokenizer = hf_target
    prompt = PROMPTS[1]
    plain, plain_text = hf_greedy(prompt, 24)
    words = (tokenizer.decode(plain[2:3]), tokenizer.decode(plain[6:8]))  # a one-token and a two-token word
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                             bad_words_ids=[tokenizer.encode(w, add_special_tokens=False) for w in words])
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected != plain_text  # the bans change the answer
    client = Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    for k in (0, 4):
        for stream in (False, True):
            result = client.generate(prompt, GenerationParams(max_tokens=24, num_draft_tokens=k, end_id=0,
                                                              bad_words=words), stream=stream)
            assert result.text == expected, (k, stream)


# ---- penalties -----------------------------------------------------------------------------------------
def _penalised_greedy(model, ids, n, repetition, presence, frequency):
    """Greedy decoding one token at a time, each position's logits penalised by the definition."""
    tokens = ids[0].tolist()
    prompt_length = len(tokens)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            output = tokens[prompt_length:]
            for token in set(tokens):
                logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
            for token in set(output):
                logits[token] = logits[token] - frequency * output.count(token) - presence
            tokens.append(int(logits.argmax()))
    return tokens[prompt_length:]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_penalties_match_transformers_and_the_definition(server, hf_target, hf_greedy, protocol):
    """repetition_penalty alone gives transformers' greedy generate with `repetition_penalty`; with presence
    and frequency penalties, greedy decoding penalised by the definition. Target-only and speculative,
    streamed or not."""
    model, tokenizer = hf_target
    prompt = PROMPTS[2]
    _, plain_text = hf_greedy(prompt, 24)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                             repetition_penalty=1.3)
    cases = [(GenerationParams(repetition_penalty=1.3),
              tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)),
             (GenerationParams(repetition_penalty=1.1, presence_penalty=0.6, frequency_penalty=0.4),
              tokenizer.decode(_penalised_greedy(model, ids, 24, 1.1, 0.6, 0.4), skip_special_tokens=True))]
    client = Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    for penalties, expected in cases:
        assert expected != plain_text  # the penalties change the answer
        for k in (0, 4):
            for stream in (False, True):
                params = dataclasses.replace(penalties, max_tokens=24, num_draft_tokens=k, end_id=0)
                assert client.generate(prompt, params, stream=stream).text == expected, (penalties, k, stream)


def test_sampled_penalised_requests_are_reproducible_and_penalised(server):
    """A seeded sampled request with penalties repeats exactly; the penalties change what it samples."""
    client = Client(server.grpc_url)
    changed = 0
    for seed in range(4):
        params = GenerationParams(max_tokens=24, num_draft_tokens=4, temperature=0.5, seed=seed, end_id=0)
        penalised = dataclasses.replace(params, repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0)
        first, again = (client.generate(PROMPTS[1], penalised).text for _ in range(2))
        assert first == again
        changed += first != client.generate(PROMPTS[1], params).text
    assert changed >= 2, changed


def test_tensorrt_llm_client_inputs_are_served(server):
    """What TensorRT-LLM's end-to-end clients send besides the prompt: bad_words and stop_words [""] for
    none, beam_width 1, exclude_input_in_output true, pad_id and end_id. The answer is the plain request's."""
    plain = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=16, num_draft_tokens=3, end_id=0)
    sent = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=16, num_draft_tokens=3, stream=True,
                       bad_words=np.array([[b""]], dtype=np.object_), stop_words=np.array([[b""]], dtype=np.object_),
                       beam_width=np.array([[1]], dtype=np.int32), exclude_input_in_output=np.array([[True]]),
                       pad_id=np.array([[2]], dtype=np.int32), end_id=np.array([[0]], dtype=np.int32))
    assert sent[tn.TEXT_OUTPUT] == plain[tn.TEXT_OUTPUT] and len(sent["chunks"]) > 1
    over_http = http_generate(server.http_url, PROMPTS[2], max_tokens=16, num_draft_tokens=3, bad_words=[""],
                              stop_words=[""], beam_width=1, exclude_input_in_output=True, pad_id=2, end_id=0)
    assert over_http[tn.TEXT_OUTPUT] == plain[tn.TEXT_OUTPUT]


def test_tensorrt_llm_end_to_end_clients_default_request_echoes_the_prompt(server, hf_target):
    """TensorRT-LLM's end-to-end client sends by default num_return_sequences 1 and exclude_input_in_output
    false, not streamed: the response holds the prompt's tokens before the generated ones (output_ids) and
    their text (text_output, decoded together, special tokens left out); a stop word stays cut; streamed,
    the chunks are the new text as always. num_output_tokens counts the generated tokens."""
    _, tokenizer = hf_target
    prompt_ids = tokenizer(PROMPTS[2]).input_ids
    plain = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=16, num_draft_tokens=3, end_id=0)
    trtllm = dict(beam_width=np.array([[1]], dtype=np.int32), num_return_sequences=np.array([[1]], dtype=np.int32),
                  exclude_input_in_output=np.array([[False]]), temperature=0.0, max_tokens=16, end_id=0)
    echoed = _stream_responses(server, tn.ENSEMBLE, {tn.TEXT_INPUT: np.array([[PROMPTS[2].encode()]], dtype=np.object_),
                                                tn.STREAM: np.array([[False]]), **{
        name: value if isinstance(value, np.ndarray) else np.array([[value]], dtype=np.float32 if name == tn.TEMPERATURE
                                                                    else np.int32)
        for name, value in trtllm.items()}})
    (answer,) = echoed
    generated = answer[tn.OUTPUT_IDS].reshape(-1).tolist()[len(prompt_ids):]
    assert answer[tn.OUTPUT_IDS].reshape(-1).tolist()[:len(prompt_ids)] == prompt_ids
    assert tokenizer.decode(generated, skip_special_tokens=True) == plain[tn.TEXT_OUTPUT]
    text = answer[tn.TEXT_OUTPUT].reshape(-1)[0].decode()
    assert text == tokenizer.decode(prompt_ids + generated, skip_special_tokens=True) and text.endswith(plain[tn.TEXT_OUTPUT])
    assert answer[tn.NUM_OUTPUT_TOKENS].reshape(-1)[0] == 16
    stop = plain[tn.TEXT_OUTPUT][len(plain[tn.TEXT_OUTPUT]) // 2:][:3]
    cut = http_generate(server.http_url, PROMPTS[2], max_tokens=16, end_id=0, exclude_input_in_output=False,
                        stop_words=[stop])
    kept = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=16, end_id=0, stop_words=np.array([[stop.encode()]],
                                                                                                   dtype=np.object_))
    assert cut[tn.TEXT_OUTPUT].endswith(kept[tn.TEXT_OUTPUT]) and stop not in cut[tn.TEXT_OUTPUT][-len(kept[tn.TEXT_OUTPUT]) - 1:]
    assert cut[tn.TEXT_OUTPUT].startswith(tokenizer.decode(prompt_ids, skip_special_tokens=True))
    streamed = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=16, num_draft_tokens=3, end_id=0, stream=True,
                           exclude_input_in_output=np.array([[False]]))
    assert streamed[tn.TEXT_OUTPUT] == plain[tn.TEXT_OUTPUT]


def test_vllm_backend_client_requests_are_served(server):
    """What clients of Triton's vLLM backend send: the sampling settings as one JSON string, and
    exclude_input_in_output. Same answer as the same settings as inputs, over gRPC and HTTP."""
    settings = json.dumps({"max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 1})
    plain = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    sent = grpc_stream(server.grpc_url, PROMPTS[0], num_draft_tokens=3, stream=True,
                       exclude_input_in_output=np.array([[True]]),
                       sampling_parameters=np.array([[settings.encode()]], dtype=np.object_))
    assert sent[tn.TEXT_OUTPUT] == plain[tn.TEXT_OUTPUT] and sent[tn.NUM_OUTPUT_TOKENS] == 12
    over_http = http_generate(server.http_url, PROMPTS[0], num_draft_tokens=3, exclude_input_in_output=True,
                              sampling_parameters=settings)
    assert over_http[tn.TEXT_OUTPUT] == plain[tn.TEXT_OUTPUT]


def _stream_responses(server, model: str, arrays: dict, parameters=None, cancel_after: int = 0) -> list:
    """One request over gRPC streaming: each response's outputs by name (or its error) in order; with
    cancel_after n the stream is cancelled after n responses."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    got = []
    try:
        client.async_stream_infer(model, grpc_inputs(arrays), parameters=parameters, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return got + [error]
            response = result.get_response()
            if response.outputs:
                got.append({output.name: result.as_numpy(output.name) for output in response.outputs})
                if cancel_after and len(got) == cancel_after:
                    client.stop_stream(cancel_requests=True)
                    return got
            final = response.parameters.get("triton_final_response")
            if final and final.bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def _vllm_backend_request(server, prompt: str, settings: dict, stream: bool, flags=tn.VLLM_OUTPUT_FLAGS) -> list[dict]:
    """A request with vLLM's backend's inputs (text_input, stream, sampling_parameters, its return_* flags)
    to the ensemble: each response's outputs by name, in order."""
    got = _stream_responses(server, tn.ENSEMBLE, {
        tn.TEXT_INPUT: np.array([[prompt.encode()]], dtype=np.object_), tn.STREAM: np.array([[stream]]),
        tn.SAMPLING_PARAMETERS: np.array([[json.dumps(settings).encode()]], dtype=np.object_),
        **{flag: np.array([[True]]) for flag in flags}})
    assert all(isinstance(r, dict) for r in got), got
    return got


@pytest.mark.parametrize("temperature,stream", [(0.0, True), (0.0, False), (1.0, True)])
def test_vllm_backend_additional_outputs(server, hf_target, temperature, stream):
    """vLLM's backend's return_* flags, with its clients' meanings: finish_reason "None" until the last
    response; num_output_tokens each response's own tokens; cumulative_logprob the sum so far; logprobs, with
    sampling_parameters' `logprobs` 2, per token the generated token (its log-probability and rank in the
    target's raw distribution, its text) and its position's two most likely, all as transformers computes
    them; num_input_tokens the prompt's. Greedy and sampled, streamed or not."""
    model, tokenizer = hf_target
    settings = {"max_tokens": 24, "temperature": temperature, "seed": 3, "ignore_eos": True, "logprobs": 2}
    responses = _vllm_backend_request(server, PROMPTS[1], settings, stream)
    assert len(responses) > 1 if stream else len(responses) == 1
    reasons = [r[tn.FINISH_REASON].reshape(-1)[0].decode() for r in responses]
    assert reasons == ["None"] * (len(responses) - 1) + ["length"]
    ids = [r[tn.OUTPUT_IDS].reshape(-1).tolist() for r in responses]
    assert [r[tn.NUM_OUTPUT_TOKENS].reshape(-1)[0] for r in responses] == [len(part) for part in ids]
    assert all(r[tn.NUM_INPUT_TOKENS].reshape(-1)[0] == len(tokenizer(PROMPTS[1]).input_ids) for r in responses)
    entries = [json.loads(r[tn.LOGPROBS].reshape(-1)[0]) for r in responses]
    assert [len(part) for part in entries] == [len(part) for part in ids]
    output = [token for part in ids for token in part]
    assert len(output) == 24
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer(PROMPTS[1]).input_ids + output])).logits[0, -25:-1].double()
    reference = torch.log_softmax(logits, -1)
    flat = [entry for part in entries for entry in part]
    for position, (token, entry) in enumerate(zip(output, flat)):
        assert list(entry)[0] == str(token)  # the generated token first
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(reference[position, token]), abs=1e-4)
        assert own["rank"] == int((logits[position] > logits[position, token]).sum()) + 1
        assert own["decoded_token"] == tokenizer.decode([token])
        top = reference[position].topk(2)
        for rank, (other, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[str(other)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert entry[str(other)]["rank"] == rank or other == token
        assert len(entry) <= 3
    if temperature:
        assert any(entry[str(token)]["rank"] > 1 for token, entry in zip(output, flat))
    cumulative = [float(r[tn.CUMULATIVE_LOGPROB].reshape(-1)[0]) for r in responses]
    sent = np.cumsum([len(part) for part in ids])
    assert cumulative == pytest.approx([float(reference[torch.arange(n), torch.tensor(output[:n])].sum())
                                        for n in sent], abs=1e-3)


def test_vllm_backend_flags_off_or_without_logprobs(server):
    """Without the flags, the outputs keep this server's meanings (finish_reason empty until the last
    response, num_output_tokens the total so far) and vLLM's two outputs are not sent; return_logprobs
    without sampling_parameters' `logprobs` sends null, as vLLM's backend does. Triton's HTTP generate
    endpoint takes the flags as JSON keys."""
    settings = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = _vllm_backend_request(server, PROMPTS[0], settings, True, flags=())
    assert len(plain) > 1 and all(tn.LOGPROBS not in r and tn.CUMULATIVE_LOGPROB not in r for r in plain)
    assert [r[tn.FINISH_REASON].reshape(-1)[0].decode() for r in plain] == [""] * (len(plain) - 1) + ["length"]
    assert plain[-1][tn.NUM_OUTPUT_TOKENS].reshape(-1)[0] == 12
    null = _vllm_backend_request(server, PROMPTS[0], settings, False, flags=(tn.RETURN_LOGPROBS,))
    assert [r[tn.LOGPROBS].reshape(-1)[0] for r in null] == [b"null"] and tn.CUMULATIVE_LOGPROB not in null[0]
    over_http = http_generate(server.http_url, PROMPTS[0], sampling_parameters=json.dumps({**settings, "logprobs": 1}),
                              return_logprobs=True, return_num_output_tokens=True, return_cumulative_logprob=True)
    assert over_http[tn.NUM_OUTPUT_TOKENS] == 12 and len(json.loads(over_http[tn.LOGPROBS])) == 12
    assert over_http[tn.CUMULATIVE_LOGPROB] < 0


def test_vllm_settings_as_request_parameters_are_served(server):
    """vLLM's backend's clients may send its settings as the request's parameters (tritonclient's
    `parameters=`; Triton's HTTP generate endpoint passes on keys that name no input as parameters): read as
    sampling_parameters' keys, a bad one refused by name (before this, every one was silently ignored)."""
    expected = grpc_stream(server.grpc_url, PROMPTS[2], max_tokens=6, ignore_eos=True, num_draft_tokens=3)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(PROMPTS[2], num_draft_tokens=3),
                                  parameters={"max_tokens": 6, "temperature": "0", "ignore_eos": True})
        result, error = responses.get(timeout=120)
        assert error is None, error
        assert result.as_numpy(tn.NUM_OUTPUT_TOKENS).reshape(-1)[0] == 6
        assert result.as_numpy(tn.TEXT_OUTPUT).reshape(-1)[0].decode() == expected[tn.TEXT_OUTPUT]
        client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(PROMPTS[2]), parameters={"max_tokens": "six"})
        result, error = responses.get(timeout=120)
        assert result is None and "request parameter 'max_tokens' must be an integer" in str(error)
        # vLLM's sample client sends its settings both ways: the input is read, as vLLM's backend reads it
        settings = {"temperature": "0", "top_p": "0.95", "max_tokens": "6", "ignore_eos": "true"}
        client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(PROMPTS[2], num_draft_tokens=3,
                                                               sampling_parameters=json.dumps(settings)),
                                  parameters=settings)
        result, error = responses.get(timeout=120)
        assert error is None, error
        assert result.as_numpy(tn.TEXT_OUTPUT).reshape(-1)[0].decode() == expected[tn.TEXT_OUTPUT]
    finally:
        client.stop_stream()
        client.close()
    over_http = http_generate(server.http_url, PROMPTS[2], num_draft_tokens=3, max_tokens=6, ignore_eos=True,
                              logprobs=1, return_logprobs=True)  # `logprobs` names no input: a parameter
    assert over_http[tn.TEXT_OUTPUT] == expected[tn.TEXT_OUTPUT] and len(json.loads(over_http[tn.LOGPROBS])) == 6
    with pytest.raises(GenerationError, match="request parameter 'use_beam_search' is not supported"):
        http_generate(server.http_url, PROMPTS[2], max_tokens=4, use_beam_search=True)


def _vllm_client_request(server, prompt: str, *, stream: bool, settings: dict | None = None, parameters=None,
                         cancel_after: int = 0, **inputs) -> list:
    """What vLLM's backend's clients send, as its sample client builds it ([1]-shaped tensors, max_batch_size
    0), to `vllm_compatible`; `inputs`: flags, or arrays of this server's inputs."""
    arrays = {tn.TEXT_INPUT: np.array([prompt.encode()], dtype=np.object_), tn.STREAM: np.array([stream]),
              **{name: value if isinstance(value, np.ndarray) else np.array([value]) for name, value in inputs.items()}}
    if settings is not None:
        arrays[tn.SAMPLING_PARAMETERS] = np.array([json.dumps(settings).encode()], dtype=np.object_)
    return _stream_responses(server, tn.VLLM_COMPATIBLE, arrays, parameters, cancel_after)


@pytest.mark.parametrize("stream", [True, False])
def test_tensorrt_llms_perf_metrics_time_every_response(server, stream):
    """return_perf_metrics (TensorRT-LLM's): every response carries arrival, first-scheduled, first-token and
    last-token times in ns of the machine's monotonic clock (this process reads the same), in that order,
    within the request's life; the first token's time stays, the last token's moves on. Without it: none."""
    arrays = {tn.TEXT_INPUT: np.array([[PROMPTS[1].encode()]], dtype=np.object_), tn.STREAM: np.array([[stream]]),
              tn.MAX_TOKENS: np.array([[24]], dtype=np.int32), tn.NUM_DRAFT_TOKENS: np.array([[3]], dtype=np.int32)}
    sent = time.monotonic_ns()
    got = _stream_responses(server, tn.ENSEMBLE, {**arrays, tn.RETURN_PERF_METRICS: np.array([[True]])})
    received = time.monotonic_ns()
    assert got and all(isinstance(r, dict) for r in got), got
    times = [[int(r[name].item()) for name in tn.PERF_METRIC_OUTPUTS] for r in got]
    assert all(r[name].dtype == np.int64 and r[name].shape == (1, 1) for r in got for name in tn.PERF_METRIC_OUTPUTS)
    assert len(got) > 2 if stream else len(got) == 1
    for arrival, scheduled, first, last in times:
        assert sent <= arrival <= scheduled <= first <= last <= received, (sent, arrival, scheduled, first, last)
    assert len({tuple(t[:3]) for t in times}) == 1  # arrival, scheduling and the first token are once
    lasts = [t[3] for t in times]
    assert lasts == sorted(lasts) and (lasts[-1] > lasts[0]) == stream
    # and its KV reuse metrics, in the target's blocks of 32: those its prompt found, those it computed so far
    for r in got:
        assert all(r[name].dtype == np.int32 and r[name].shape == (1, 1) for name in tn.KV_CACHE_METRIC_OUTPUTS)
        reused, new, total = (int(r[name].item()) for name in tn.KV_CACHE_METRIC_OUTPUTS)
        spanned = -(-(int(r[tn.NUM_INPUT_TOKENS].item()) + int(r[tn.NUM_OUTPUT_TOKENS].item())) // 32)
        assert reused * 32 == int(r[tn.NUM_CACHED_TOKENS].item()) and new == total == spanned - reused > 0
    plain = _stream_responses(server, tn.ENSEMBLE, arrays)
    assert plain and not any(name in r for r in plain for name in tn.PERF_METRIC_OUTPUTS + tn.KV_CACHE_METRIC_OUTPUTS)


def test_vllm_backend_clients_are_served_as_they_are(server):
    """vllm_compatible takes what vLLM's backend's clients send ([1]-shaped tensors, which the batching
    ensemble refuses) and answers as vLLM's backend does: the ensemble's text, with the prompt before it when
    not streamed (unless exclude_input_in_output); the additional outputs only with their flags, of vLLM's
    types; settings as sampling_parameters or as the request's parameters; errors named."""
    settings = {"temperature": "0", "top_p": "0.95", "max_tokens": "12", "ignore_eos": "true"}
    expected = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=12, ignore_eos=True)
    # vLLM's sample client: the settings both as the input and as the request's parameters, only text_output read
    whole = _vllm_client_request(server, PROMPTS[0], stream=False, settings=settings, parameters=settings)
    assert len(whole) == 1 and set(whole[0]) == {tn.TEXT_OUTPUT}
    assert whole[0][tn.TEXT_OUTPUT].tolist() == [(PROMPTS[0] + expected[tn.TEXT_OUTPUT]).encode()]
    excluded = _vllm_client_request(server, PROMPTS[0], stream=False, parameters=settings,
                                    exclude_input_in_output=True)
    assert excluded[0][tn.TEXT_OUTPUT].tolist() == [expected[tn.TEXT_OUTPUT].encode()]
    streamed = _vllm_client_request(server, PROMPTS[0], stream=True, settings={**settings, "logprobs": 1},
                                    **{flag: True for flag in tn.VLLM_OUTPUT_FLAGS})
    assert len(streamed) > 1
    assert b"".join(r[tn.TEXT_OUTPUT][0] for r in streamed).decode() == expected[tn.TEXT_OUTPUT]
    assert [r[tn.FINISH_REASON].tolist() for r in streamed] == [[b"None"]] * (len(streamed) - 1) + [[b"length"]]
    assert sum(int(r[tn.NUM_OUTPUT_TOKENS][0]) for r in streamed) == 12
    assert all(r[tn.NUM_OUTPUT_TOKENS].dtype == np.uint32 and r[tn.NUM_INPUT_TOKENS].shape == (1,) for r in streamed)
    assert sum(len(json.loads(r[tn.LOGPROBS][0])) for r in streamed) == 12
    assert streamed[-1][tn.CUMULATIVE_LOGPROB].dtype == np.float32 and streamed[-1][tn.CUMULATIVE_LOGPROB][0] < 0
    # this server's draft inputs beside vLLM's, [1]-shaped too
    drafted = _vllm_client_request(server, PROMPTS[0], stream=False, parameters=settings, exclude_input_in_output=True,
                                   num_draft_tokens=np.array([3], dtype=np.int32), adaptive_draft=False,
                                   draft_model=np.array([b"ngram"], dtype=np.object_))
    assert drafted[0][tn.TEXT_OUTPUT].tolist() == [expected[tn.TEXT_OUTPUT].encode()]
    errors = [_vllm_client_request(server, PROMPTS[0], stream=True, exclude_input_in_output=False)[-1],
              _vllm_client_request(server, PROMPTS[0], stream=False,
                                   draft_model=np.array([b"nonexistent"], dtype=np.object_))[-1],
              _vllm_client_request(server, PROMPTS[0], stream=False, settings={"max_tokens": 0})[-1],
              _vllm_client_request(server, PROMPTS[0], stream=False, parameters={"n": 3})[-1]]
    assert "'exclude_input_in_output' false is not allowed when streaming" in str(errors[0])
    assert f"input '{tn.DRAFT_MODEL}' must be one of" in str(errors[1])
    assert f"'{tn.MAX_TOKENS}' must be within" in str(errors[2])
    assert "request parameter 'n' is supported only at 1" in str(errors[3])


def test_a_cancelled_vllm_backend_stream_stops_its_generation(server):
    """A client's cancellation of a vllm_compatible stream reaches the generation running behind it (through
    the cancellation board: a BLS request cannot be cancelled): the target stops within a round or two."""
    rounds = server.metric("specdec_rounds_total")
    got = _vllm_client_request(server, PROMPTS[1], stream=True, cancel_after=2,
                               settings={"max_tokens": 900, "ignore_eos": True})
    assert len(got) == 2 and all(isinstance(r, dict) for r in got)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        settled = server.metric("specdec_rounds_total")
        time.sleep(1.0)
        if server.metric("specdec_rounds_total") == settled:
            break
    assert settled - rounds < 100, settled - rounds  # 900 tokens would take hundreds of rounds


def test_vllm_token_id_settings_are_served(server, hf_target, hf_greedy):
    """sampling_parameters' logit_bias and allowed_token_ids give greedy decoding of the served target under
    the definition; stop_token_ids end the text before the first of them. K 0 and 4, gRPC and HTTP."""
    model, tokenizer = hf_target
    prompt = PROMPTS[1]
    plain_ids, plain_text = hf_greedy(prompt, 16)
    bias = {plain_ids[0]: -100.0, plain_ids[3]: 5.0}
    allowed = sorted(set(range(0, len(tokenizer), 3)) | set(bias))
    ids = tokenizer(prompt).input_ids
    expected = []
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([ids + expected])).logits[0, -1]
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed] = 0.0
            for token, value in bias.items():
                keep[token] += value
            expected.append(int((logits + keep).argmax()))
    expected_text = tokenizer.decode(expected, skip_special_tokens=True)
    assert expected_text != plain_text
    settings = {"max_tokens": 16, "logit_bias": {str(t): v for t, v in bias.items()}, "allowed_token_ids": allowed}
    stop = plain_ids[4]
    for k in (0, 4):
        answer = http_generate(server.http_url, prompt, num_draft_tokens=k, end_id=0,
                               sampling_parameters=json.dumps(settings))
        assert answer[tn.TEXT_OUTPUT] == expected_text, k
        stopped = grpc_stream(server.grpc_url, prompt, num_draft_tokens=k, end_id=0, sampling_parameters=np.array(
            [[json.dumps({"max_tokens": 16, "stop_token_ids": [stop]}).encode()]], dtype=np.object_))
        assert stopped[tn.TEXT_OUTPUT] == tokenizer.decode(plain_ids[:plain_ids.index(stop)], skip_special_tokens=True)
        assert stopped[tn.FINISH_REASON] == tn.FINISH_STOP


def test_tensorrt_llms_embedding_bias_is_served(server, hf_target, hf_greedy):
    """embedding_bias_words / _weights (TensorRT-LLM's): greedy decoding of the served target with each word's
    tokens' logits moved by its weight, summed where words share a token. K 0 and 4, gRPC and HTTP."""
    model, tokenizer = hf_target
    prompt = PROMPTS[1]
    plain_ids, plain_text = hf_greedy(prompt, 16)
    words = [tokenizer.decode([plain_ids[0]]), tokenizer.decode(plain_ids[2:4]), "", tokenizer.decode([plain_ids[3]])]
    weights = [-100.0, 3.0, 50.0, 2.5]  # the empty word's weight goes nowhere
    bias = torch.zeros(model.config.vocab_size)
    for word, weight in zip(words, weights):
        for token in tokenizer.encode(word, add_special_tokens=False):
            bias[token] += weight
    ids, expected = tokenizer(prompt).input_ids, []
    with torch.no_grad():
        for _ in range(16):
            expected.append(int((model(torch.tensor([ids + expected])).logits[0, -1] + bias).argmax()))
    expected_text = tokenizer.decode(expected, skip_special_tokens=True)
    assert expected_text != plain_text
    tensors = {tn.EMBEDDING_BIAS_WORDS: np.array([[w.encode() for w in words]], dtype=np.object_),
               tn.EMBEDDING_BIAS_WEIGHTS: np.array([weights], dtype=np.float32)}
    for k in (0, 4):
        streamed = grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=k, end_id=0, **tensors)
        assert streamed[tn.TEXT_OUTPUT] == expected_text, k
        answer = http_generate(server.http_url, prompt, max_tokens=16, num_draft_tokens=k, end_id=0,
                               **{tn.EMBEDDING_BIAS_WORDS: words, tn.EMBEDDING_BIAS_WEIGHTS: weights})
        assert answer[tn.TEXT_OUTPUT] == expected_text, k
    with pytest.raises(GenerationError, match="'embedding_bias_words' and 'embedding_bias_weights' are pairs"):
        grpc_stream(server.grpc_url, prompt, max_tokens=4, **{**tensors, tn.EMBEDDING_BIAS_WEIGHTS:
                                                              np.array([[1.0]], dtype=np.float32)})


def test_vllm_text_settings_are_served(server, hf_target, hf_greedy):
    """sampling_parameters' include_stop_str_in_output keeps the stop word at the text's end (streamed or
    not), truncate_prompt_tokens generates from the prompt's last tokens, and vLLM's neutral
    skip_special_tokens / spaces_between_special_tokens / detokenize are accepted."""
    model, tokenizer = hf_target
    prompt = PROMPTS[1]
    _, plain_text = hf_greedy(prompt, 16)
    stop = plain_text[len(plain_text) // 2:len(plain_text) // 2 + 3]
    assert stop.strip() and plain_text.find(stop) > 0
    kept = plain_text[:plain_text.index(stop) + len(stop)]
    settings = json.dumps({"max_tokens": 16, "stop": [stop], "include_stop_str_in_output": True,
                           "skip_special_tokens": True, "spaces_between_special_tokens": True, "detokenize": True})
    for k in (0, 4):
        answer = http_generate(server.http_url, prompt, num_draft_tokens=k, sampling_parameters=settings)
        assert answer[tn.TEXT_OUTPUT] == kept and answer[tn.FINISH_REASON] == tn.FINISH_STOP, k
        streamed = grpc_stream(server.grpc_url, prompt, num_draft_tokens=k, stream=True,
                               sampling_parameters=np.array([[settings.encode()]], dtype=np.object_))
        assert "".join(streamed["chunks"]) == kept, k
    ids = tokenizer(prompt).input_ids
    last = ids[-3:]
    expected = []
    with torch.no_grad():
        for _ in range(8):
            expected.append(int(model(torch.tensor([last + expected])).logits[0, -1].argmax()))
    answer = http_generate(server.http_url, prompt, num_draft_tokens=4, end_id=0, sampling_parameters=json.dumps(
        {"max_tokens": 8, "truncate_prompt_tokens": 3}))
    assert answer[tn.NUM_INPUT_TOKENS] == 3 and len(ids) > 3
    assert answer[tn.TEXT_OUTPUT] == tokenizer.decode(expected, skip_special_tokens=True)


# ---- structured output ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guides(hf_target):
    from specdec.decoding.grammar import GuideCompiler

    return GuideCompiler(hf_target[1])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_structured_output_is_constrained_greedy_target_decoding(server, hf_target, guides, protocol):
    """A JSON schema guide: target-only and speculative, streamed or not, the text is greedy decoding of the
    served target masked token by token by a fresh matcher, and it parses as the schema says. target_model
    picks the tokens with the grammar's bitmask; their log-probabilities are the raw distribution's."""
    from tests.unit.test_grammar import SCHEMA, constrained_greedy

    model, tokenizer = hf_target
    prompt = PROMPTS[2]
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    prompt_ids = tokenizer(prompt).input_ids
    output_ids = constrained_greedy(model, guides, grammar, prompt_ids, 40)
    expected = tokenizer.decode(output_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:-1]
    expected_log_probs = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0]
    value = json.loads(expected)
    assert set(value) == {"name", "age"} and len(value["name"]) <= 6 and 0 <= value["age"] <= 99
    client = Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    for k in (0, 4):
        for stream in (False, True):
            params = GenerationParams(max_tokens=40, num_draft_tokens=k, guide_type="json_schema", guide=json.dumps(SCHEMA))
            result = client.generate(prompt, params, stream=stream)
            assert (result.text, result.finish_reason) == (expected, tn.FINISH_STOP), (k, stream)
        params = GenerationParams(max_tokens=40, num_draft_tokens=k, guide_type="json_schema", guide=json.dumps(SCHEMA),
                                  return_log_probs=True)
        assert client.generate(prompt, params).log_probs == pytest.approx(expected_log_probs.tolist(), abs=1e-4), k
    # vLLM's form of the same guide; with vLLM's logprobs output the orchestrator ranks the tokens from the
    # target's logits instead of letting the target pick: the same text, every token's rank in the raw
    # distribution (the grammar may choose others than the first)
    settings = {"max_tokens": 40, "guided_decoding": {"json": SCHEMA, "backend": "xgrammar"}}
    assert http_generate(server.http_url, prompt, num_draft_tokens=4,
                         sampling_parameters=json.dumps(settings))[tn.TEXT_OUTPUT] == expected
    ranked = http_generate(server.http_url, prompt, num_draft_tokens=4, return_logprobs=True,
                           sampling_parameters=json.dumps({**settings, "logprobs": 0}))
    entries = json.loads(ranked[tn.LOGPROBS])
    assert ranked[tn.TEXT_OUTPUT] == expected and [int(next(iter(entry))) for entry in entries] == output_ids
    ranks = [entry[str(token)]["rank"] for entry, token in zip(entries, output_ids)]
    assert ranks == [int((row > row[token]).sum()) + 1 for row, token in zip(logits, output_ids)]


def test_sampled_structured_output_keeps_to_its_guide(server):
    """Seeded sampled requests with a choice, a regex and any-JSON guide: every answer follows its guide,
    repeats exactly with its seed, and the seeds do not all give one answer."""
    client = Client(server.grpc_url)
    choices = ["red", "green", "blue", "purple"]
    seen = set()
    for seed in range(8):
        settings = json.dumps({"temperature": 4.0, "seed": seed, "max_tokens": 8,  # this target likes "purple"
                               "structured_outputs": {"choice": choices}})
        answers = [http_generate(server.http_url, PROMPTS[0], num_draft_tokens=3, sampling_parameters=settings)
                   for _ in range(2)]
        assert answers[0][tn.TEXT_OUTPUT] == answers[1][tn.TEXT_OUTPUT] in choices
        assert answers[0][tn.FINISH_REASON] == tn.FINISH_STOP
        seen.add(answers[0][tn.TEXT_OUTPUT])
    assert len(seen) > 1
    for seed in range(3):
        params = GenerationParams(max_tokens=24, num_draft_tokens=4, temperature=0.8, seed=seed,
                                  guide_type="regex", guide="[a-z]{2,8}-[0-9]{3}")
        assert re.fullmatch("[a-z]{2,8}-[0-9]{3}", client.generate(PROMPTS[1], params, stream=True).text)
        any_json = client.generate(PROMPTS[1], dataclasses.replace(params, max_tokens=64, guide_type="json", guide=None))
        if any_json.finish_reason == tn.FINISH_STOP:
            assert isinstance(json.loads(any_json.text), dict)
        else:  # cut by max_tokens: an object's beginning
            assert any_json.text.startswith("{") and any_json.finish_reason == tn.FINISH_LENGTH


def test_a_large_guide_compiles_on_a_thread_and_is_served(server):
    """A guide over THREAD_GUIDE_CHARS compiles off the orchestrator's event loop: served alike, greedy K=0
    and K=4 equal, the JSON keeping to the schema; a plain stream beside it finishes too."""
    from specdec.triton.orchestrator import THREAD_GUIDE_CHARS

    optional = {f"note_{i:04d}": {"type": "string", "description": "padding " * 4} for i in range(300)}
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12}, **optional},
              "x-guidance": {"whitespace_flexible": False}}
    guide = json.dumps(schema)
    assert THREAD_GUIDE_CHARS < len(guide) <= 65536
    client = Client(server.grpc_url)
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(client.generate, PROMPTS[0], GenerationParams(max_tokens=24, ignore_eos=True), True)
        answers = [pool.submit(client.generate, PROMPTS[1], GenerationParams(
            max_tokens=48, num_draft_tokens=k, guide_type="json_schema", guide=guide)) for k in (0, 4)]
        texts = [answer.result().text for answer in answers]
        assert plain.result().num_output_tokens == 24
    assert texts[0] == texts[1]
    if answers[0].result().finish_reason == tn.FINISH_STOP:
        value = json.loads(texts[0])
        assert "city" in value and set(value) <= set(schema["properties"])
    else:
        assert texts[0].startswith('{"')


def test_structured_bench_served_mode(server):
    """`bench/structured_bench.py --url`: every schema and whitespace setting served, speculative text equal
    to target-only text; with --stall, its three phases run."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "structured_bench.py"
    result = subprocess.run([sys.executable, str(script), "--url", server.grpc_url, "--max-tokens", "16",
                             "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| person") or line.startswith("| book")]
    assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows)
    # --stall: plain streams' response gaps alone, then beside guided requests (the same schema, new ones).
    result = subprocess.run([sys.executable, str(script), "--url", server.grpc_url, "--stall", "--streams", "2",
                             "--seconds", "2", "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| plain")
            or line.startswith("| +")]
    assert len(rows) == 3 and all(int(row[1]) > 0 for row in rows)  # plain responses in every phase
    assert not rows[0][5].strip() and all(int(row[5]) > 0 for row in rows[1:])  # guided requests beside them


# ---- validation --------------------------------------------------------------------------------------
LONG_PROMPT = "word " * 1100

BAD_REQUESTS = {
    "max_tokens_zero": (PROMPTS[0], dict(max_tokens=0), "max_tokens"),
    "max_tokens_over_limit": (PROMPTS[0], dict(max_tokens=5000), "max_tokens"),
    "temperature_negative": (PROMPTS[0], dict(temperature=-0.5), "temperature"),
    "temperature_nan": (PROMPTS[0], dict(temperature=float("nan")), "temperature"),
    "top_p_zero": (PROMPTS[0], dict(top_p=0.0), "top_p"),
    "top_p_above_one": (PROMPTS[0], dict(top_p=1.5), "top_p"),
    "top_k_negative": (PROMPTS[0], dict(top_k=-1), "top_k"),
    "min_p_above_one": (PROMPTS[0], dict(min_p=np.array([[1.5]], dtype=np.float32)), "min_p"),
    "num_draft_tokens_negative": (PROMPTS[0], dict(num_draft_tokens=-1), "num_draft_tokens"),
    "num_draft_tokens_over_max": (PROMPTS[0], dict(num_draft_tokens=17), "num_draft_tokens"),
    "empty_prompt": ("", {}, "text_input"),
    "missing_prompt": (None, dict(max_tokens=5), "text_input"),
    "only_chat_template": (None, dict(apply_chat_template=True), "text_input"),
    # a request's own template: this server does not take one (no trust_request_chat_template)
    "request_chat_template_untrusted": (None, dict(messages='[{"role": "user", "content": "hi"}]',
                                                   chat_template="{{ messages[0].content }}"),
                                        "'chat_template': this server does not take a request's chat template"),
    "blank_prompt": ("   ", {}, "text_input"),
    "prompt_over_context": (LONG_PROMPT, dict(max_tokens=10), "context"),
    "end_id_out_of_range": (PROMPTS[0], dict(end_id=10**8), "end_id"),
    "min_length_over_max_tokens": (PROMPTS[0], dict(max_tokens=5, min_length=6), "min_length"),
    "min_tokens_over_max_tokens": (PROMPTS[0], dict(max_tokens=5, min_tokens=np.array([[6]], dtype=np.int32)),
                                   "min_tokens"),
    "min_length_and_min_tokens_disagree": (PROMPTS[0], dict(max_tokens=5, min_length=2,
                                                            min_tokens=np.array([[3]], dtype=np.int32)), "min_tokens"),
    "unknown_draft_model": (PROMPTS[0], dict(draft_model="nope"), "draft_model"),
    "too_many_stop_words": (PROMPTS[0], dict(stop_words=np.array([[b"w%d" % i for i in range(17)]], dtype=np.object_)),
                            "stop_words"),
    "too_many_bad_words": (PROMPTS[0], dict(bad_words=np.array([[b" w%d" % i for i in range(17)]], dtype=np.object_)),
                           "bad_words"),
    "sampling_parameters_unknown_key": (PROMPTS[0], dict(sampling_parameters=np.array([[b'{"use_beam_search": true}']],
                                                                                      dtype=np.object_)),
                                        "use_beam_search"),
    "logit_bias_out_of_range": (PROMPTS[0], dict(sampling_parameters=np.array([[b'{"logit_bias": {"5": 101}}']],
                                                                              dtype=np.object_)), "logit_bias"),
    "stop_token_id_beyond_vocabulary": (PROMPTS[0], dict(sampling_parameters=np.array(
        [[b'{"stop_token_ids": [100000000]}']], dtype=np.object_)), "stop_token_ids"),
    "sampling_parameters_and_input": (PROMPTS[0], dict(max_tokens=5, sampling_parameters=np.array(
        [[b'{"max_tokens": 6}']], dtype=np.object_)), "sampling_parameters"),
    "repetition_penalty_zero": (PROMPTS[0], dict(repetition_penalty=np.array([[0.0]], dtype=np.float32)),
                                "repetition_penalty"),
    "presence_penalty_over_2": (PROMPTS[0], dict(presence_penalty=np.array([[2.5]], dtype=np.float32)),
                                "presence_penalty"),
    "frequency_penalty_nan": (PROMPTS[0], dict(frequency_penalty=np.array([[np.nan]], dtype=np.float32)),
                              "frequency_penalty"),
    "sampling_parameters_penalty": (PROMPTS[0], dict(sampling_parameters=np.array(
        [[b'{"frequency_penalty": -3}']], dtype=np.object_)), "frequency_penalty"),
    "guide_type_unknown": (PROMPTS[0], dict(guided_decoding_guide_type=np.array([[b"xml"]], dtype=np.object_),
                                            guided_decoding_guide=np.array([[b"<a/>"]], dtype=np.object_)),
                           "guided_decoding_guide_type"),
    "guide_does_not_compile": (PROMPTS[0], dict(guided_decoding_guide_type=np.array([[b"regex"]], dtype=np.object_),
                                                guided_decoding_guide=np.array([[b"[0-9"]], dtype=np.object_)),
                               "guided_decoding_guide"),
    "guide_schema_invalid": (PROMPTS[0], dict(sampling_parameters=np.array(
        [[b'{"guided_decoding": {"json": {"type": "foo"}}}']], dtype=np.object_)), "guided_decoding_guide"),
    "guide_too_many_choices": (PROMPTS[0], dict(sampling_parameters=np.array(
        [[json.dumps({"guided_decoding": {"choice": [f"c{i}" for i in range(1025)]}}).encode()]], dtype=np.object_)),
        "guided_decoding_guide"),
    "reasoning_parser_unknown": (PROMPTS[0], dict(guided_decoding_guide_type=np.array([[b"json"]], dtype=np.object_),
                                                  reasoning_parser=np.array([[b"o1"]], dtype=np.object_)),
                                 "reasoning_parser"),
    # a number no input holds: numpy raised on it after the request was accepted, and it was never answered
    "seed_beyond_64_bits": (PROMPTS[0], dict(sampling_parameters=np.array([[b'{"seed": 1e308}']], dtype=np.object_)),
                            "seed"),
    "token_id_a_list": (PROMPTS[0], dict(sampling_parameters=np.array([[b'{"allowed_token_ids": [[1]]}']],
                                                                       dtype=np.object_)), "allowed_token_ids"),
    "spaces_between_special_tokens_false": (PROMPTS[0], dict(sampling_parameters=np.array(
        [[b'{"spaces_between_special_tokens": false}']], dtype=np.object_)), "spaces_between_special_tokens"),
    "truncate_prompt_tokens_zero": (PROMPTS[0], dict(sampling_parameters=np.array(
        [[b'{"truncate_prompt_tokens": 0}']], dtype=np.object_)), "truncate_prompt_tokens"),
    "guide_over_max_guide_chars": (PROMPTS[0], dict(guided_decoding_guide_type=np.array([[b"regex"]], dtype=np.object_),
                                                    guided_decoding_guide=np.array([[b"a" * 65537]], dtype=np.object_)),
                                   "guided_decoding_guide"),
    "pad_id_negative": (PROMPTS[0], dict(pad_id=np.array([[-1]], dtype=np.int32)), "pad_id"),
    "beam_width_2": (PROMPTS[0], dict(beam_width=np.array([[2]], dtype=np.int32)), "beam_width"),
    "beam_width_wrong_dtype": (PROMPTS[0], dict(beam_width=np.array([[1]], dtype=np.uint32)), "beam_width"),
    "exclude_input_in_output_not_bool": (PROMPTS[0], dict(exclude_input_in_output=np.array([[0]], dtype=np.int32)),
                                         "exclude_input_in_output"),
    "num_return_sequences_2": (PROMPTS[0], dict(num_return_sequences=np.array([[2]], dtype=np.int32)),
                               "num_return_sequences"),
    "wrong_dtype": (PROMPTS[0], dict(max_tokens=np.array([[5.0]], dtype=np.float32)), "max_tokens"),
    "wrong_shape": (PROMPTS[0], dict(max_tokens=np.array([[5, 6]], dtype=np.int32)), "max_tokens"),
    "unknown_input": (PROMPTS[0], dict(frobnicate=np.array([[1]], dtype=np.int32)), "frobnicate"),
}


def _invalid_utf8_request(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput(tn.TEXT_INPUT, [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"bad \xff\xfe bytes"]], dtype=np.object_))
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(tn.ENSEMBLE, [text])
    result, error = responses.get(timeout=60)
    client.stop_stream()
    return error


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_a_clear_error_naming_the_field(server, case):
    prompt, params, field = BAD_REQUESTS[case]
    with pytest.raises(GenerationError, match=field):
        grpc_stream(server.grpc_url, prompt, timeout=60, **params)
    assert server.ready()


@pytest.mark.parametrize("stream", [False, True])
def test_missing_prompt_over_http_names_text_input(server, stream):
    """Triton 24.10 checks an ensemble request's number of inputs, not which: without text_input it used to
    complete with an empty answer."""
    with pytest.raises(GenerationError, match="'text_input' is required"):
        http_generate(server.http_url, None, timeout=60, stream=stream, max_tokens=5)
    assert server.ready()


def test_invalid_utf8_prompt_is_rejected(server):
    error = _invalid_utf8_request(server)
    assert error is not None and "text_input" in str(error) and "UTF-8" in str(error)


def test_bad_inputs_concurrent_with_good_requests(server):
    expected = {p: grpc_stream(server.grpc_url, p, max_tokens=16, num_draft_tokens=3)[tn.TEXT_OUTPUT]
                for p in PROMPTS}

    def bad(case):
        prompt, params, field = BAD_REQUESTS[case]
        try:
            grpc_stream(server.grpc_url, prompt, timeout=60, **params)
        except GenerationError as exc:
            return field in str(exc)
        return False

    def good(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        return grpc_stream(server.grpc_url, prompt, max_tokens=16, num_draft_tokens=3,
                           stream=bool(i % 2))[tn.TEXT_OUTPUT] == expected[prompt]

    with ThreadPoolExecutor(12) as pool:
        bad_results = pool.map(bad, sorted(BAD_REQUESTS))
        good_results = pool.map(good, range(8))
        assert all(bad_results) and all(good_results)
    assert server.ready()
    for model in ("draft_model", "target_model"):
        assert server.metric("specdec_model_live_sequences", model=model) == 0


# ---- concurrency --------------------------------------------------------------------------------------
def test_sixteen_concurrent_streams_equal_their_solo_text(server):
    solo = {p: grpc_stream(server.grpc_url, p, max_tokens=24, num_draft_tokens=4)[tn.TEXT_OUTPUT] for p in PROMPTS}

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        return prompt, grpc_stream(server.grpc_url, prompt, max_tokens=24, num_draft_tokens=4, stream=True)

    with ThreadPoolExecutor(16) as pool:
        for prompt, result in pool.map(one, range(16)):
            assert result[tn.TEXT_OUTPUT] == solo[prompt], prompt
