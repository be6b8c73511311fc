"""The orchestrator's metrics: rounds are counted locally and sent in batches, with the same totals; at
unload every metric is let go while the stub still runs."""

import subprocess
import sys
import weakref

from specdec.triton import adapter
from specdec.engine.hosted_heads import HeadTotals
from specdec.triton.metrics import HostedHeadMetrics, ModelMetrics, OrchestratorMetrics


class FakeMetric:
    def __init__(self, log, name, labels):
        self.log, self.key = log, (name, tuple(sorted(labels.items())))

    def increment(self, value):
        self.log.append(("inc", self.key, value))

    def observe(self, value):
        self.log.append(("obs", self.key, value))

    def set(self, value):
        self.log.append(("set", self.key, value))


class FakePbUtils:
    """Just enough of triton_python_backend_utils.MetricFamily; every call is logged (each is an IPC)."""

    def __init__(self):
        self.log = []
        self.made = []  # weak references to every family and metric made
        log, made = self.log, self.made

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name = name
                made.append(weakref.ref(self))

            def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
                metric = FakeMetric(log, self.name, labels)
                made.append(weakref.ref(metric))
                return metric

        self.MetricFamily = MetricFamily


def totals(log):
    out = {}
    for op, key, value in log:
        if op == "inc":
            out[key] = out.get(key, 0) + value
        elif op == "obs":
            out.setdefault(("observed",) + key, []).append(value)
    return out


def test_rounds_are_batched_and_flushed_with_exact_totals():
    pb = FakePbUtils()
    metrics = OrchestratorMetrics(pb, max_num_draft_tokens=4)
    rounds = [(4, 2), (0, 0), (3, 3), (4, 0), (1, 1)]
    for i, (drafted, accepted) in enumerate(rounds):
        metrics.record_round(drafted, accepted, now=1.0 + 0.01 * i)
    metrics.record_load_limited()
    metrics.record_load_limited()
    sent_before_flush = list(pb.log)
    metrics.flush(now=1.1)
    got = totals(pb.log)
    assert len(sent_before_flush) < len(pb.log) / 2  # most updates waited for the flush
    assert got[("specdec_rounds_total", ())] == 5
    assert got[("specdec_draft_tokens_total", ())] == 12
    assert got[("specdec_accepted_draft_tokens_total", ())] == 6
    assert got[("specdec_drafted_at_position_total", (("position", "1"),))] == 4
    assert got[("specdec_drafted_at_position_total", (("position", "4"),))] == 2
    assert got[("specdec_accepted_at_position_total", (("position", "1"),))] == 3
    assert got[("specdec_accepted_at_position_total", (("position", "3"),))] == 1
    assert sorted(got[("observed", "specdec_accepted_length", ())]) == [0.0, 1.0, 2.0, 3.0]
    assert got[("specdec_load_limited_rounds_total", ())] == 2
    pb.log.clear()
    metrics.flush(now=1.2)
    assert pb.log == []  # nothing pending: nothing sent


def test_a_finished_request_is_observed_in_its_phases_and_sizes():
    """record_request: prefill (start of generating to first token), decode (first to last), inference (both),
    time per output token after the first, and the prompt, output and max_tokens sizes; a request that never
    started (max_tokens 0, no times) only counts."""
    from specdec import tensor_names as tn

    pb = FakePbUtils()
    metrics = OrchestratorMetrics(pb, max_num_draft_tokens=2)
    pb.log.clear()
    times = {tn.ARRIVAL_TIME_NS: 10.0, tn.FIRST_SCHEDULED_TIME_NS: 10.5, tn.FIRST_TOKEN_TIME_NS: 11.0,
             tn.LAST_TOKEN_TIME_NS: 13.0}
    metrics.record_request("length", 5, 3.5, prompt_tokens=7, times=times, max_tokens=5)
    got = totals(pb.log)
    assert {name: got[("observed", name, ())] for name in (
        "specdec_request_prefill_seconds", "specdec_request_decode_seconds", "specdec_request_inference_seconds",
        "specdec_time_per_output_token_seconds", "specdec_request_prompt_tokens", "specdec_request_output_tokens",
        "specdec_request_max_tokens", "specdec_request_latency_seconds")} == {
        "specdec_request_prefill_seconds": [0.5], "specdec_request_decode_seconds": [2.0],
        "specdec_request_inference_seconds": [2.5], "specdec_time_per_output_token_seconds": [0.5],
        "specdec_request_prompt_tokens": [7], "specdec_request_output_tokens": [5], "specdec_request_max_tokens": [5],
        "specdec_request_latency_seconds": [3.5]}
    pb.log.clear()
    metrics.record_round(0, 0, 20.0, gap_s=0.25)  # a round's time since the request's previous tokens
    metrics.record_round(0, 0, 20.1)  # (its first tokens: no gap)
    metrics.flush(20.2)
    assert totals(pb.log)[("observed", "specdec_inter_token_latency_seconds", ())] == [0.25]
    pb.log.clear()
    metrics.record_request("cancelled", 0, 0.2)
    assert [key[0] for op, key, _ in pb.log if op == "obs"] == ["specdec_request_latency_seconds"]


def test_a_round_after_half_a_second_flushes_on_its_own():
    pb = FakePbUtils()
    metrics = OrchestratorMetrics(pb, max_num_draft_tokens=2)
    metrics.record_round(2, 1, now=10.0)  # the first flush is due at once (nothing flushed yet)
    metrics.record_round(2, 2, now=10.1)
    assert totals(pb.log)[("specdec_rounds_total", ())] == 1
    metrics.record_round(1, 0, now=10.7)
    assert totals(pb.log)[("specdec_rounds_total", ())] == 3


def test_hosted_heads_work_is_sent_in_batches_with_exact_totals(monkeypatch):
    """target_model's hosted heads: each head's totals since load become counter increments, at most twice a
    second unless flushed, nothing sent for what did not change."""
    pb = FakePbUtils()
    metrics = HostedHeadMetrics(pb, "target_model", ["eagle3", "other"])
    clock = iter([10.0, 10.1, 10.7, 11.0])
    monkeypatch.setattr("specdec.triton.metrics.time.monotonic", lambda: next(clock))
    totals = {"eagle3": HeadTotals(0.25, 3, 7, 0), "other": HeadTotals()}
    metrics.report(totals, flush=False)
    sent = len(pb.log)
    totals["eagle3"] = HeadTotals(0.5, 5, 11, 1)
    metrics.report(totals, flush=False)  # 0.1 s later: held
    assert len(pb.log) == sent
    metrics.report(totals, flush=False)
    metrics.report(totals, flush=True)  # nothing new: nothing sent
    key = lambda name: (name, (("head", "eagle3"), ("model", "target_model")))  # noqa: E731
    assert totals_sent(pb.log) == {key("specdec_hosted_head_seconds_total"): 0.5,
                                   key("specdec_hosted_head_proposals_total"): 5,
                                   key("specdec_hosted_head_draft_tokens_total"): 11,
                                   key("specdec_hosted_head_failures_total"): 1}


def totals_sent(log):
    return {key: value for key, value in totals(log).items() if key[0] != "observed"}


def test_close_lets_go_of_every_metric_and_family():
    """Left to the stub's exit, a metric's destructor reaches the stub being torn down: every stub with
    metrics segfaulted at each unload (triton-inference-server/server#8662). The models' finalize closes
    their metrics first; the integration tests' stop_server checks the kernel's log for crashed stubs."""
    pb = FakePbUtils()
    metrics = [OrchestratorMetrics(pb, max_num_draft_tokens=4), ModelMetrics(pb, "target_model"),
               HostedHeadMetrics(pb, "target_model", ["eagle3"])]
    metrics[0].record_round(4, 2, now=1.0)
    metrics[1].report(10, 1, 1024, flush=True)
    metrics[2].report({"eagle3": HeadTotals(0.1, 1, 2, 0)}, flush=True)
    assert pb.made and all(ref() is not None for ref in pb.made)
    for each in metrics:
        each.close()
    assert [ref for ref in pb.made if ref() is not None] == []


def test_finalize_skips_the_interpreters_teardown_only_in_a_stub(monkeypatch):
    """After finalize a stub exits at once (os._exit from the first exit handler); any other process
    (a test calling finalize) keeps its exit code."""
    registered = []
    monkeypatch.setattr(adapter.atexit, "register", registered.append)
    monkeypatch.delitem(sys.modules, adapter.STUB_MODULE, raising=False)
    adapter.TritonAdapter().finalize()
    assert registered == []
    monkeypatch.setitem(sys.modules, adapter.STUB_MODULE, object())
    adapter.TritonAdapter().finalize()
    assert registered == [adapter._exit_now]


def test_a_crashed_stub_leaves_every_threads_python_stack_in_the_log():
    """report_crashes (every adapter's initialize): a segfault prints each thread's Python stack to stderr,
    which tritonserver's log carries; without it a process that reads no environment (the stub) prints nothing."""
    code = ("import faulthandler, threading, time\n"
            "from specdec.triton.adapter import report_crashes\n"
            "def waiting_for_an_answer():\n"
            "    time.sleep(30)\n"
            "threading.Thread(target=waiting_for_an_answer, daemon=True).start()\n"
            "time.sleep(0.2)\n"
            "report_crashes() if __import__('sys').argv[1] == 'on' else None\n"
            "faulthandler._sigsegv()\n")
    crashed = {flag: subprocess.run([sys.executable, "-I", "-c", code, flag], capture_output=True, text=True,
                                    timeout=60) for flag in ("on", "off")}
    assert crashed["on"].returncode != 0 and "Fatal Python error: Segmentation fault" in crashed["on"].stderr
    assert "in waiting_for_an_answer" in crashed["on"].stderr  # the other thread's stack too
    assert "Fatal Python error" not in crashed["off"].stderr  # -I: like the stub, no environment read
