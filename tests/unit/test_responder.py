"""pipelined_execute: execute runs its batch and returns; the model's responder thread answers every
request exactly once, through its sender (responder.py, language_models.py)."""

import threading
import time
import types

import numpy as np

from specdec import tensor_names as tn
from specdec.engine import host_memory
from specdec.engine.build import dynamic_executor
from specdec.triton.language_models import DraftModel, TargetModel
from specdec.triton.responder import Job, Responder

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
                                TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, Logger=types.SimpleNamespace(log_warn=print))


def _adapter(cls, lm, pipelined):
    adapter = cls.__new__(cls)  # the execute logic only: no Triton stub here
    adapter.pb, adapter.name, adapter.lm, adapter.batched = FAKE_PB, cls.__name__, lm, True
    adapter.device_outputs, adapter.forward_seconds, adapter.trims = True, 0.0, host_memory.TrimSchedule(0.0)
    adapter._lock = threading.Lock()
    adapter._report_metrics = lambda flush: None
    adapter.responder = adapter._responder() if pipelined else None
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
        if adapter.responder is None:
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
    """Three rounds of two or three sequences (a bad step in the first and the last), then the releases."""
    return [
        [_verify(1, [5, 6, 7], 0, 1), _verify(2, [9, 8], 0, 2), _verify(3, [1], 4, 1)],  # 3: no cache
        [_verify(1, [4, 4, 4], 3, 3), _verify(2, [3], 1, 1)],  # 2 rolls back to 1 token
        [_verify(1, [2], 5, 1), _verify(2, [7, 7], 2, 2), _verify(4, [], 0, 1)],  # 4: no tokens
        [_verify(1, [], 0, 0, release=True), _verify(2, [], 0, 0, release=True)],
    ]


def test_pipelined_target_answers_each_request_once_as_the_synchronous_path(tiny_lm):
    plain = _serve(_adapter(TargetModel, dynamic_executor(tiny_lm), pipelined=False), _rounds())
    adapter = _adapter(TargetModel, dynamic_executor(tiny_lm), pipelined=True)
    try:
        piped = _serve(adapter, _rounds())
    finally:
        adapter.responder.stop()
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


def test_execute_returns_before_its_responses_are_sent(tiny_lm):
    adapter = _adapter(TargetModel, dynamic_executor(tiny_lm), pipelined=True)
    gate, send = threading.Event(), adapter._send

    def held_send(job, response):
        assert gate.wait(10)
        send(job, response)
    adapter.responder._send = held_send
    try:
        request = _verify(1, [5, 6, 7], 0, 2)
        assert adapter.execute([request]) is None
        assert not request.sent and 1 in adapter.lm.sequences  # the forward ran, the response waits
        gate.set()
        _wait_answered([request])
    finally:
        adapter.responder.stop()
    assert request.sent[0][1].tensors[tn.GREEDY_TOKENS].shape == (1, 2)


def test_the_responder_answers_in_order_past_failures_and_after_it_stopped():
    answered, gate, logged = [], threading.Event(), []

    def answer(job, outcome):
        if outcome == "bad answer":
            raise AssertionError("answer must not raise; the responder logs it and goes on")
        return (job.seq_id, outcome)

    def send(job, response):
        assert gate.wait(10)
        if job.seq_id == 3:
            raise RuntimeError("the client is gone")
        answered.append((response, threading.current_thread().name))
    responder = Responder("t", answer, send, logged.append)
    responder.submit([Job(None, 1), Job(None, 2), Job(None, 3)], ["a", "bad answer", "c"])
    responder.submit([Job(None, 4)], ["d"])
    gate.set()
    responder.stop()  # what is queued is sent first
    assert answered == [((1, "a"), "t-responder"), ((4, "d"), "t-responder")]
    assert [line.split(":")[0] for line in logged] == ["could not answer sequence 2", "could not answer sequence 3"]
    responder.submit([Job(None, 5)], ["e"])  # after unloading: answered at once, here
    assert answered[-1] == ((5, "e"), threading.current_thread().name)


def test_pipelined_draft_proposes_what_the_synchronous_path_proposes(tiny_lm):
    def rounds():
        return [[_Request(seq, [tn.DRAFT_TOKENS], **{tn.INPUT_IDS: [[5, 6, seq]], tn.CACHE_LENGTH: [[0]],
                                                     tn.NUM_DRAFT_TOKENS: [[4]]}) for seq in (1, 2)],
                [_Request(1, [tn.DRAFT_TOKENS], **{tn.INPUT_IDS: [[9]], tn.CACHE_LENGTH: [[4]],
                                                   tn.NUM_DRAFT_TOKENS: [[2]]})]]
    results = []
    for pipelined in (False, True):
        adapter = _adapter(DraftModel, dynamic_executor(tiny_lm), pipelined)
        try:
            results.append([r.tensors[tn.DRAFT_TOKENS].tolist() for r in _serve(adapter, rounds())])
        finally:
            if adapter.responder is not None:
                adapter.responder.stop()
    assert results[0] == results[1] and [len(t[0]) for t in results[0]] == [4, 4, 2]


def test_the_target_reports_the_rows_its_forward_ran_not_those_the_prefix_cache_held(tiny_lm):
    """A prompt found in the prefix cache runs its last rows only, and its forward_stats say so: counted as
    sent, a long cached prompt priced every verify up to its length at the cost of a few rows."""
    adapter = _adapter(TargetModel, dynamic_executor(tiny_lm, prefix_cache_tokens=256, block_size=4), pipelined=False)
    prompt = list(range(3, 21))  # 18 tokens: 4 blocks of 4 cached once the first request ran it
    answers = _serve(adapter, [[_verify(1, prompt, 0, 1)], [_verify(1, [], 0, 0, release=True)], [_verify(2, prompt, 0, 1)]])
    rows = [answers[i].tensors[tn.FORWARD_STATS].reshape(-1).tolist()[0] for i in (0, 2)]
    assert rows == [18, 2]


def test_the_draft_reports_the_batched_execution_each_call_ran_in(tiny_lm):
    """forward_stats, when asked for: the orchestrator charges a draft call its share of the draft's device
    time (draft_length.CostModel.draft_cost); the calls of one execute share one execution."""
    adapter = _adapter(DraftModel, dynamic_executor(tiny_lm), pipelined=False)
    batch = [_Request(seq, [tn.DRAFT_TOKENS, tn.FORWARD_STATS] if seq < 3 else [tn.DRAFT_TOKENS],
                      **{tn.INPUT_IDS: [[5, 6, seq]], tn.CACHE_LENGTH: [[0]], tn.NUM_DRAFT_TOKENS: [[3]]})
             for seq in (1, 2, 3)]
    answers = _serve(adapter, [batch])
    stats = [answer.tensors[tn.FORWARD_STATS].reshape(-1).tolist() for answer in answers[:2]]
    assert stats[0] == stats[1] and stats[0][:2] == [9, 3] and stats[0][2] > 0  # 9 rows of 3 sequences
    assert tn.FORWARD_STATS not in answers[2].tensors  # not asked for


def test_pipelined_execute_is_off_by_default_and_a_config_parameter():
    from specdec.serving.pairs import REPO_ROOT

    for model in ("target_model", "draft_model"):
        config = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
        assert 'key: "pipelined_execute", value: { string_value: "false" }' in config


def test_a_prompt_scored_in_chunks_gets_every_tokens_log_probability(tiny_lm):
    """target_model's score rows: a chunk that verifies nothing scores its last row against score_next (the
    next chunk's first token); the last call scores the rest and verifies its positions; together each prompt
    token's log-probability and top rows, as one forward over the prompt gives them. A chunk without
    score_next is refused naming it."""
    import torch

    prompt = [5, 17, 3, 88, 41, 9, 60, 12]
    scored = [tn.GREEDY_TOKENS, tn.SCORED_LOG_PROBS, tn.SCORED_TOP_IDS, tn.SCORED_TOP_LOG_PROBS]

    def step(seq_id, ids, keep, num_logits, rows, after=-1):
        return _Request(seq_id, scored, **{tn.INPUT_IDS: [ids], tn.CACHE_LENGTH: [[keep]], tn.NUM_LOGITS: [[num_logits]],
                                           tn.SCORE_ROWS: [[rows]], tn.SCORE_NEXT: [[after]]})
    adapter = _adapter(TargetModel, dynamic_executor(tiny_lm), pipelined=False)
    first, last, bad = _serve(adapter, [[step(1, prompt[:3], 0, 0, 3, prompt[3])], [step(1, prompt[3:], 3, 1, 4)],
                                        [step(2, prompt[:3], 0, 0, 3)]])
    with torch.no_grad():
        rows = torch.log_softmax(tiny_lm(torch.tensor([prompt])).logits[0].double(), -1)
    values = np.concatenate([first.tensors[tn.SCORED_LOG_PROBS].reshape(-1), last.tensors[tn.SCORED_LOG_PROBS].reshape(-1)])
    assert np.allclose(values, rows[torch.arange(7), torch.tensor(prompt[1:])].numpy(), atol=1e-6)
    tops = np.concatenate([first.tensors[tn.SCORED_TOP_IDS][0], last.tensors[tn.SCORED_TOP_IDS][0]])
    assert tops.shape == (7, tn.MAX_TOP_LOG_PROBS) and (tops[:, 0] == rows[:7].argmax(-1).numpy()).all()
    assert first.tensors[tn.GREEDY_TOKENS].size == 0  # a chunk verifies nothing
    assert last.tensors[tn.GREEDY_TOKENS].reshape(-1).tolist() == [int(rows[7].argmax())]
    assert bad.error is not None and tn.SCORE_NEXT in bad.error.message
