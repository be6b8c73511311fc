"""Concurrent requests share the draft and target forward passes (issue: batched speculation).

16 mixed requests at once: different prompts, lengths, K, draft methods, streaming or not, adaptive or
not, two cancelled mid-stream. Every finished one equals its solo target-only output token for token,
the models really ran batched forwards (fewer executions than requests), and every cache is freed.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import tensor_names as tn
from specdec.serving.metrics_text import samples

from .helpers import grpc_stream, open_stream_and_cancel, run_bench

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there, how are you today?", "Once upon a time, in a land far away,",
           "The quick brown fox jumps over the lazy dog.", "def fibonacci(n):",
           "A B C D E F G H I J K L M N", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
           "Speculative decoding drafts tokens with a small model and", "日本語のテキストと emoji 🎉 mixed"]
DRAFTS = ["draft_model", "ngram", "draft_model_exact", "draft_model_random"]
CANCELLED = {5, 12}


def case(i):
    return dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=12 + 6 * (i % 4), num_draft_tokens=(0, 1, 3, 5, 8)[i % 5],
                draft_model=DRAFTS[i % len(DRAFTS)], stream=bool(i % 2), adaptive_draft=bool(i % 3))


def test_sixteen_concurrent_mixed_requests_equal_their_solo_outputs(server):
    cases = [case(i) for i in range(16)]
    solo = {i: grpc_stream(server.grpc_url, c["prompt"], max_tokens=c["max_tokens"], num_draft_tokens=0)
            for i, c in enumerate(cases) if i not in CANCELLED}
    executions = {m: server.metric("nv_inference_exec_count", model=m) for m in ("target_model", "draft_model")}
    requests = {m: server.metric("nv_inference_request_success", model=m) for m in ("target_model", "draft_model")}

    def one(i):
        c = cases[i]
        if i in CANCELLED:
            return open_stream_and_cancel(server.grpc_url, c["prompt"], **{k: v for k, v in c.items() if k != "prompt"})
        return grpc_stream(server.grpc_url, c["prompt"], **{k: v for k, v in c.items() if k != "prompt"})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, result in enumerate(results):
        if i in CANCELLED:
            continue
        assert result[tn.TEXT_OUTPUT] == solo[i][tn.TEXT_OUTPUT], cases[i]
        assert result[tn.NUM_OUTPUT_TOKENS] == solo[i][tn.NUM_OUTPUT_TOKENS]
        if cases[i]["stream"]:
            assert "".join(result["chunks"]) == result[tn.TEXT_OUTPUT]
    # Batched: the target ran fewer forward passes than it answered steps.
    target_steps = server.metric("nv_inference_request_success", model="target_model") - requests["target_model"]
    target_execs = server.metric("nv_inference_exec_count", model="target_model") - executions["target_model"]
    assert target_execs < target_steps, (target_execs, target_steps)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = [server.metric("specdec_live_sequences"), server.metric("specdec_queued_requests"),
                server.metric("specdec_model_live_sequences", model="draft_model"),
                server.metric("specdec_model_live_sequences", model="target_model"),
                server.metric("specdec_model_kv_cache_bytes", model="target_model")]
        if live == [0, 0, 0, 0, 0]:
            break
        time.sleep(0.5)
    assert live == [0, 0, 0, 0, 0]


@pytest.fixture(scope="module", params=["queue", "reject"])
def capped(request, tmp_path_factory):
    """(when_full, server): a server that lets two requests generate at once (max_live_sequences=2) and
    queues or rejects the others; one per policy, shared by the tests of a full server."""
    import dataclasses

    from specdec.serving import pairs, repository

    from .helpers import retire_server, start_server

    tmp_path = tmp_path_factory.mktemp(f"capped-{request.param}")
    pair = dataclasses.replace(pairs.tiny_pair(), max_live_sequences=2, when_full=request.param)
    srv = start_server(tmp_path, repository=repository.render(pair, tmp_path / "repo"))
    yield request.param, srv
    retire_server(srv, require_clean_exit=False)


def test_live_sequence_cap_queues_or_rejects(capped):
    """max_live_sequences=2: six concurrent requests either all finish (queued for a slot) or the ones
    over the cap get UNAVAILABLE with a retry hint; never more than two generate at once."""
    from .helpers import GenerationError

    when_full, srv = capped
    queued_before = srv.metric("specdec_queue_time_seconds_count")
    rejected_before = srv.metric("specdec_requests_total", finish_reason="rejected")

    def one(i):
        try:
            return grpc_stream(srv.grpc_url, PROMPTS[i], max_tokens=60, num_draft_tokens=3, stream=True)
        except GenerationError as exc:
            return exc

    peak_queued = 0
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        while not all(f.done() for f in futures):
            peak_queued = max(peak_queued, srv.metric("specdec_queued_requests"))
            time.sleep(0.05)
        results = [f.result() for f in futures]
    # The server's own high-water mark: sampling the live gauge could miss a brief excess. Each
    # orchestrator instance reports the highest slot it took; the cap holds across instances.
    peaks = [value for _, value in samples(srv.metrics(), "specdec_live_sequences_peak")]
    assert len(peaks) == tn.DEFAULT_ORCHESTRATOR_INSTANCES["cpu"] and max(peaks) == 2, peaks
    assert srv.metric("specdec_max_live_sequences") == 2  # the chart's backlog signal divides by it
    errors = [r for r in results if isinstance(r, Exception)]
    if when_full == "queue":
        assert errors == [] and peak_queued >= 1
        # The slot waits are in the queue-time histogram: six requests, some of them waited.
        assert srv.metric("specdec_queue_time_seconds_count") - queued_before == 6
        assert srv.metric("specdec_queue_time_seconds_sum") > 0
        assert all(r[tn.FINISH_REASON] in ("length", "stop") and r[tn.TEXT_OUTPUT] for r in results)
        _a_direct_caller_cancelled_in_the_slot_queue_leaves_it(srv)
    else:
        assert errors and all("max_live_sequences" in str(e) and "retry later" in str(e) for e in errors)
        assert srv.metric("specdec_requests_total", finish_reason="rejected") - rejected_before == len(errors)
        assert len(errors) < 6


def _a_direct_caller_cancelled_in_the_slot_queue_leaves_it(srv):
    """Both slots busy with long generations; a client calling speculative_decoding itself waits for a
    slot and cancels: its request leaves the queue within a cancellation check, not when a slot frees."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from client.sync import grpc_inputs

    cancelled_before = srv.metric("specdec_requests_total", finish_reason="cancelled")
    with ThreadPoolExecutor(2) as pool:
        longs = [pool.submit(grpc_stream, srv.grpc_url, PROMPTS[i], max_tokens=900, num_draft_tokens=0,
                             ignore_eos=True) for i in range(2)]
        deadline = time.monotonic() + 60
        while srv.metric("specdec_live_sequences") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        client.start_stream(callback=lambda result, error: None)
        client.async_stream_infer(tn.SPECULATIVE_DECODING, grpc_inputs({
            tn.INPUT_IDS: np.array([[1, 400, 2000, 37]], dtype=np.int32), tn.MAX_TOKENS: np.array([[50]], dtype=np.int32),
            tn.STREAM: np.array([[True]])}))
        while srv.metric("specdec_queued_requests") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.metric("specdec_queued_requests") == 1
        client.stop_stream(cancel_requests=True)
        client.close()
        left = time.monotonic() + 5
        while srv.metric("specdec_queued_requests") and time.monotonic() < left:
            time.sleep(0.05)
        assert srv.metric("specdec_queued_requests") == 0
        assert srv.metric("specdec_requests_total", finish_reason="cancelled") == cancelled_before + 1
        assert not any(f.done() for f in longs)  # it left the line while both slots were still taken
        assert all(f.result()[tn.NUM_OUTPUT_TOKENS] == 900 for f in longs)


# ---- one input set per model ------------------------------------------------------------------------------
DELAY_US = 200_000  # the models' batcher waits this long for more sequences: concurrent steps meet in it


@pytest.fixture(scope="module")
def waiting(tmp_path_factory):
    """A server whose models' sequence batchers wait for more sequences before each execution."""
    import dataclasses

    from specdec.serving import pairs, repository

    from .helpers import retire_server, start_server

    tmp_path = tmp_path_factory.mktemp("batcher-delay")
    pair = dataclasses.replace(pairs.tiny_pair(test_drafts=True), orchestrator_instances=1)
    repo = repository.render(pair, tmp_path / "repo")
    for model in ("target_model", *pair.draft_paths):
        repository.override(repo, f"{model}.max_queue_delay_microseconds={DELAY_US}")
    server = start_server(tmp_path, repository=repo)
    yield server
    retire_server(server)


@pytest.mark.parametrize("drafting", [False, True])
def test_steps_of_every_kind_share_executions(waiting, server, drafting):
    """Triton's sequence batcher puts requests into one execution only when they carry the same inputs, so
    target-only steps, verifies of several lengths, with a grammar's bitmask or not, greedy and sampled
    drafts, first steps and later ones must all send one input set per model (bls.py), or they run in
    executions of their own. Four such streams at once, with the batchers waiting for each other's steps:
    the executions carry most of them (with sets apart, greedy and sampled drafts never shared one), and
    each stream's text is its solo text (from the suite's server of the same pair, whose batchers do not
    wait: greedy and seeded text depends on neither). Without a draft model every stream's round is one
    target step; with one, every stream drafts."""
    guided = dict(guided_decoding_guide_type="regex", guided_decoding_guide="[a-z ]{100,}")
    if drafting:
        # The exact draft (the target's weights) has every draft accepted: the streams end together.
        kinds = [dict(num_draft_tokens=3), dict(num_draft_tokens=3, temperature=0.7, seed=5),
                 dict(num_draft_tokens=3, temperature=0.8, seed=3), dict(num_draft_tokens=3, temperature=1.0, seed=4)]
        draft = "draft_model_exact"
    else:
        kinds = [dict(num_draft_tokens=0), dict(num_draft_tokens=0, **guided), dict(num_draft_tokens=3),
                 dict(num_draft_tokens=2, temperature=0.8, seed=3)]
        draft = "ngram"
    params = [dict(max_tokens=24, ignore_eos=True, adaptive_draft=False, draft_model=draft, **kind) for kind in kinds]
    solo = [grpc_stream(server.grpc_url, PROMPTS[i], **p) for i, p in enumerate(params)]
    models = ("target_model", draft) if drafting else ("target_model",)
    counts = lambda: {(name, m): waiting.metric(name, model=m)  # noqa: E731
                      for name in ("nv_inference_exec_count", "nv_inference_request_success") for m in models}
    before = counts()
    with ThreadPoolExecutor(len(params)) as pool:
        together = list(pool.map(lambda i: grpc_stream(waiting.grpc_url, PROMPTS[i], **params[i]), range(len(params))))
    assert [r[tn.TEXT_OUTPUT] for r in together] == [r[tn.TEXT_OUTPUT] for r in solo]
    after = counts()
    per_execution = {m: (after["nv_inference_request_success", m] - before["nv_inference_request_success", m])
                     / (after["nv_inference_exec_count", m] - before["nv_inference_exec_count", m]) for m in models}
    print(f"steps per execution: {per_execution}")
    assert all(steps > 2.5 for steps in per_execution.values()), per_execution


def test_the_mixed_load_bench_runs_against_a_server(server, tmp_path):
    """`bench/mixed_load.py`: every mix runs and reports throughput and the target's steps per execution."""
    out = tmp_path / "mixed.md"
    run_bench("mixed_load.py", "--url", server.grpc_url, "--metrics-url", server.metrics_url, "--streams", "2",
              "--seconds", "2", "--max-tokens", "8", "--out", str(out))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines() if line.startswith("| ")]
    assert [row[0] for row in rows[1:]] == ["k0", "k0-k4", "default", "default-guided"]
    assert all(float(row[1]) > 0 and float(row[2]) >= 1.0 for row in rows[1:]), rows


def test_waiting_requests_are_admitted_by_priority(capped, tmp_path):
    """Both slots held by long streams: requests of priorities 5, 0, 0 and -1, each sent once the one before
    waits, are admitted -1 first, then the two 0s in arrival order, then 5 (their first_scheduled_time_ns,
    the moment they got a slot) as the holders are cancelled one by one; each generates the text it would
    alone. With when_full=reject a priority changes nothing: refused like any other while full."""
    import queue
    import threading

    import tritonclient.grpc as grpcclient

    from .helpers import GenerationError, ensemble_inputs

    when_full, srv = capped
    holders = []
    for prompt in PROMPTS[:2]:
        client, chunks = grpcclient.InferenceServerClient(srv.grpc_url), queue.Queue()
        client.start_stream(callback=lambda result, error, chunks=chunks: chunks.put(error))
        client.async_stream_infer(tn.ENSEMBLE, ensemble_inputs(prompt, max_tokens=900, stream=True, end_id=0))
        assert chunks.get(timeout=60) is None  # generating
        holders.append(client)
    try:
        if when_full == "reject":
            with pytest.raises(GenerationError, match="retry later"):
                grpc_stream(srv.grpc_url, PROMPTS[2], max_tokens=8, priority=-100)
            return
        queued = srv.metric("specdec_queued_requests")
        results, threads = {}, []
        for name, priority in (("five", 5), ("zero", 0), ("zero again", 0), ("minus one", -1)):
            def one(name=name, priority=priority):
                results[name] = grpc_stream(srv.grpc_url, PROMPTS[2], max_tokens=8, num_draft_tokens=3,
                                            priority=priority, return_perf_metrics=True)
            threads.append(threading.Thread(target=one))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while srv.metric("specdec_queued_requests") < queued + len(threads) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert srv.metric("specdec_queued_requests") == queued + len(threads), f"{name} is not waiting"
        for client in holders:  # one slot at a time
            client.stop_stream(cancel_requests=True)
            time.sleep(0.3)
        for thread in threads:
            thread.join(60)
        order = sorted(results, key=lambda name: results[name][tn.FIRST_SCHEDULED_TIME_NS])
        assert order == ["minus one", "zero", "zero again", "five"], {n: r[tn.FIRST_SCHEDULED_TIME_NS] for n, r in results.items()}
        alone = grpc_stream(srv.grpc_url, PROMPTS[2], max_tokens=8, num_draft_tokens=3)
        assert {r[tn.TEXT_OUTPUT] for r in results.values()} == {alone[tn.TEXT_OUTPUT]}
    finally:
        for client in holders:
            client.stop_stream(cancel_requests=True)
            client.close()
    # `make bench-priority`'s script against this full server: both phases measured (figures: docs/results)
    out = tmp_path / "priority.md"
    run_bench("priority_bench.py", "--url", srv.grpc_url, "--background", "3", "--urgent", "2", "--rounds", "1",
              "--settle", "0.5", "--max-tokens", "8", "--out", str(out))
    rows = {line.split("|")[1].strip(): line for line in out.read_text().splitlines() if line.startswith("| urgent")}
    assert set(rows) == {"urgent at priority 0", "urgent at priority -1"}, out.read_text()


def test_two_hundred_streams_against_two_slots(capped):
    """Load far beyond capacity: 200 concurrent streams against max_live_sequences 2. Each one completes or
    (reject) is refused UNAVAILABLE with a retry hint; none is lost or hangs; the server stays ready
    throughout; afterwards no slot, queue place or cache is held (the waiting line is a ticket per
    waiting request: bounded by the requests, and empty again)."""
    import threading
    import urllib.error
    import urllib.request

    import subprocess

    from specdec.triton.admission import kv_room, sequence_slots

    from .helpers import GenerationError

    when_full, srv = capped
    queued_before = srv.metric("specdec_queue_time_seconds_count")
    rejected_before = srv.metric("specdec_requests_total", finish_reason="rejected")
    not_ready, done = [], threading.Event()

    def watch_readiness():
        while not done.wait(0.2):
            try:
                urllib.request.urlopen(srv.readiness_url, timeout=5).close()
            except (urllib.error.URLError, OSError) as exc:
                not_ready.append(str(exc))

    def one(i):
        try:
            return grpc_stream(srv.grpc_url, PROMPTS[i % len(PROMPTS)], timeout=240, max_tokens=4 + i % 5,
                               num_draft_tokens=3, draft_model=DRAFTS[i % 2], stream=True)
        except GenerationError as exc:
            return exc

    try:
        watcher = threading.Thread(target=watch_readiness, daemon=True)
        watcher.start()
        with ThreadPoolExecutor(200) as pool:
            results = list(pool.map(one, range(200)))
        done.set()
        watcher.join()
        errors = [r for r in results if isinstance(r, Exception)]
        finished = [r for r in results if not isinstance(r, Exception)]
        assert len(errors) + len(finished) == 200
        assert all(r[tn.FINISH_REASON] in ("length", "stop") and r[tn.TEXT_OUTPUT] for r in finished)
        assert not not_ready, not_ready[:3]
        peaks = [value for _, value in samples(srv.metrics(), "specdec_live_sequences_peak")]
        assert max(peaks) <= 2
        if when_full == "queue":
            assert errors == []
            assert srv.metric("specdec_queue_time_seconds_count") - queued_before == 200
        else:
            assert errors and all("max_live_sequences" in str(e) and tn.RETRY_LATER in str(e) for e in errors)
            assert srv.metric("specdec_requests_total", finish_reason="rejected") - rejected_before == len(errors)
        text = srv.metrics()
        assert sum(v for _, v in samples(text, "specdec_live_sequences")) == 0
        assert sum(v for _, v in samples(text, "specdec_queued_requests")) == 0
        # The server's waiting lines (a ticket file per waiting request) are empty again.
        server_pid = int(subprocess.run(["pgrep", "-P", str(srv.process.pid), "tritonserver"], capture_output=True,
                                        text=True).stdout.split()[0])
        lines = [d / "line" for d in sequence_slots.server_directories(server_pid)]
        lines.append(kv_room.default_directory(server_pid) / "line")
        assert lines[0].is_dir() and [t for line in lines if line.is_dir() for t in line.iterdir()] == []
    finally:
        done.set()
