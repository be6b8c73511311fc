"""pipelined_execute: execute hands the steps over and returns; the model's threads run them and answer
every request exactly once, through its sender (pipeline.py, language_models.py)."""

import threading
import time
import types

import numpy as np
from specdec import tensor_names as tn
from specdec.engine.executor import CausalLM
from specdec.triton.language_models import DraftModel, TargetModel
from specdec.triton.pipeline import Job, Pipeline

from .conftest import FakeTensor


class _Sender:
    def __init__(self, sent, request):
        self.sent, self.request = sent, request

    def send(self, response, flags=0):
        self.sent.append((self.request, response, flags))


class _Request:
    """What the adapters ask of a pb_utils.InferenceRequest."""

    def __init__(self, seq_id, outputs=(), **inputs):
        self.seq_id, self.outputs = seq_id, list(outputs)
        self._inputs = [FakeTensor(name, value) for name, value in inputs.items()]
        self.sent = []

    def correlation_id(self):
        return self.seq_id

    def inputs(self):
        return list(self._inputs)

    def requested_output_names(self):
        return self.outputs

    def get_response_sender(self):
        return _Sender(self.sent, self)


class _Response:
    def __init__(self, output_tensors=(), error=None):
        self.tensors = {t.name: t.value for t in output_tensors}
        self.error = error


class _Error:
    INTERNAL, UNAVAILABLE = "INTERNAL", "UNAVAILABLE"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class _OutTensor:
    def __init__(self, name, value):
        self.name, self.value = name, np.asarray(value)


FAKE_PB = types.SimpleNamespace(InferenceResponse=_Response, TritonError=_Error, Tensor=_OutTensor,
                                TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)


def _adapter(cls, lm, pipelined):
    adapter = cls.__new__(cls)  # the execute logic only: no Triton stub here
    adapter.pb, adapter.name, adapter.lm, adapter.batched = FAKE_PB, cls.__name__, lm, True
    adapter.device_outputs, adapter.forward_seconds, adapter._freed_since_trim = True, 0.0, False
    adapter._lock = threading.Lock()
    adapter._report_metrics = lambda flush: None
    adapter.pipeline = Pipeline("test", adapter._run_locked, adapter._answer, adapter._send, print) \
        if pipelined else None
    return adapter


def _verify(seq_id, ids, keep, num_logits, release=False):
    return _Request(seq_id, [tn.GREEDY_TOKENS, tn.LOGITS, tn.FORWARD_STATS],
                    **{tn.INPUT_IDS: [ids], tn.CACHE_LENGTH: [[keep]], tn.NUM_LOGITS: [[num_logits]],
                       tn.RELEASE: [[release]]})


def _wait_answered(requests, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while any(not r.sent for r in requests):
        assert time.monotonic() < deadline, "a request was never answered"
        time.sleep(0.005)


def _serve(adapter, batches):
    """Every batch through execute; the responses per request, in request order."""
    answered = []
    for batch in batches:
        returned = adapter.execute(batch)
        if adapter.pipeline is None:
            for request, response in zip(batch, returned):
                request.sent.append((request, response, 1))
        else:
            assert returned is None  # answered through the senders
        answered += batch
    _wait_answered(answered)
    for request in answered:
        assert len(request.sent) == 1 and request.sent[0][2] == 1  # exactly one response, final
    return [request.sent[0][1] for request in answered]


def _rounds():
    """Three rounds of three sequences (one with a bad step), then their releases."""
    return [
        [_verify(1, [5, 6, 7], 0, 1), _verify(2, [9, 8], 0, 2), _verify(3, [1], 4, 1)],  # 3: no cache
        [_verify(1, [4, 4, 4], 3, 3), _verify(2, [3], 1, 1)],  # 2 rolls back to 1 token
        [_verify(1, [2], 5, 1), _verify(2, [7, 7], 2, 2), _verify(4, [], 0, 1)],  # 4: no tokens
        [_verify(1, [], 0, 0, release=True), _verify(2, [], 0, 0, release=True)],
    ]


def test_pipelined_target_answers_each_request_once_as_the_synchronous_path(tiny_lm):
    plain = _serve(_adapter(TargetModel, CausalLM(tiny_lm), pipelined=False), _rounds())
    adapter = _adapter(TargetModel, CausalLM(tiny_lm), pipelined=True)
    try:
        piped = _serve(adapter, _rounds())
    finally:
        adapter.pipeline.stop()
    assert len(piped) == len(plain) == 10
    for a, b in zip(plain, piped):
        assert (a.error is None) == (b.error is None)
        if a.error is not None:
            assert a.error.message == b.error.message and "TargetModel:" in a.error.message
            continue
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            if name == tn.FORWARD_STATS:  # rows and sequences of its forward; the seconds differ
                continue
            np.testing.assert_allclose(a.tensors[name], b.tensors[name], rtol=0, atol=1e-10)
    assert adapter.lm.sequences == {}  # released


def test_steps_queued_while_a_forward_runs_share_the_next_forward(tiny_lm):
    adapter = _adapter(TargetModel, CausalLM(tiny_lm), pipelined=True)
    gate, calls = threading.Event(), []
    run = adapter._run_jobs

    def slow_run(jobs):  # the first forward waits until every other step has been handed over
        calls.append(sorted(job.seq_id for job in jobs))
        if len(calls) == 1:
            assert gate.wait(10)
        return run(jobs)
    adapter._run_jobs = slow_run
    try:
        first = [_verify(1, [5, 6], 0, 1)]
        adapter.execute(first)
        time.sleep(0.05)  # the runner has taken it
        later = [[_verify(seq, [5, 6], 0, 1)] for seq in (2, 3, 4)] + [[_verify(1, [3], 2, 1)]]
        for batch in later:
            assert adapter.execute(batch) is None
        gate.set()
        _wait_answered(first + [r for batch in later for r in batch])
    finally:
        adapter.pipeline.stop()
    # Everything handed over while the first forward ran shares the next: sequence 1's next step too,
    # its first step being done by then.
    assert calls == [[1], [1, 2, 3, 4]], calls
    assert all(r.sent[0][1].error is None for batch in later for r in batch)


def test_one_sequence_runs_once_per_batch_in_the_order_its_jobs_came():
    seen, answered = [], []
    pipeline = Pipeline("t", lambda jobs: seen.append([(j.seq_id, j.step) for j in jobs]) or [j.step for j in jobs],
                        lambda job, outcome: (job.seq_id, outcome), lambda job, response: answered.append(response),
                        print)
    pipeline._ready.acquire()  # hold the runner until all jobs are queued
    try:
        pipeline._pending.extend([Job(None, 1, "a"), Job(None, 2, "b"), Job(None, 1, "c"), Job(None, 1, "d")])
        pipeline._ready.notify()
    finally:
        pipeline._ready.release()
    deadline = time.monotonic() + 10
    while len(answered) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    pipeline.stop()
    assert seen == [[(1, "a"), (2, "b")], [(1, "c")], [(1, "d")]]
    assert sorted(answered) == [(1, "a"), (1, "c"), (1, "d"), (2, "b")]


def test_a_failing_batch_and_an_unloading_model_still_answer_every_job():
    answered, release = [], threading.Event()

    def run(jobs):
        if jobs[0].step == "boom":
            raise ValueError("the forward broke")
        assert release.wait(10)
        return ["ok"] * len(jobs)
    pipeline = Pipeline("t", run, lambda job, outcome: (job.seq_id, str(outcome)),
                        lambda job, response: answered.append(response), print)
    pipeline.submit([Job(None, 1, "boom")])
    deadline = time.monotonic() + 10
    while not answered and time.monotonic() < deadline:
        time.sleep(0.005)
    assert answered == [(1, "ValueError: the forward broke")]
    pipeline.submit([Job(None, 2, "slow")])  # in flight when the model unloads
    time.sleep(0.05)
    pipeline.submit([Job(None, 3, "queued")])
    threading.Timer(0.1, release.set).start()
    pipeline.stop()
    pipeline.submit([Job(None, 4, "late")])  # after unloading: answered at once
    assert sorted(answered[1:]) == [(2, "ok"), (3, "the model is unloading"), (4, "the model is unloading")]


def test_pipelined_draft_proposes_what_the_synchronous_path_proposes(tiny_lm):
    def rounds():
        return [[_Request(seq, [tn.DRAFT_TOKENS], **{tn.INPUT_IDS: [[5, 6, seq]], tn.CACHE_LENGTH: [[0]],
                                                     tn.NUM_DRAFT_TOKENS: [[4]]}) for seq in (1, 2)],
                [_Request(1, [tn.DRAFT_TOKENS], **{tn.INPUT_IDS: [[9]], tn.CACHE_LENGTH: [[4]],
                                                   tn.NUM_DRAFT_TOKENS: [[2]]})]]
    results = []
    for pipelined in (False, True):
        adapter = _adapter(DraftModel, CausalLM(tiny_lm), pipelined)
        try:
            results.append([r.tensors[tn.DRAFT_TOKENS].tolist() for r in _serve(adapter, rounds())])
        finally:
            if adapter.pipeline is not None:
                adapter.pipeline.stop()
    assert results[0] == results[1] and [len(t[0]) for t in results[0]] == [4, 4, 2]


def test_pipelined_execute_is_off_by_default_and_a_config_parameter():
    from specdec.serving.pairs import REPO_ROOT

    for model in ("target_model", "draft_model"):
        config = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
        assert 'key: "pipelined_execute", value: { string_value: "false" }' in config

