"""Every Prometheus metric the project defines, on Triton's metrics port (pb_utils.MetricFamily):
the orchestrator's (`OrchestratorMetrics`), draft_model's / target_model's (`ModelMetrics`), target_model's
hosted heads' (`HostedHeadMetrics`) and a layer-skip draft's search (`SkipMetrics`).

docs/deployment.md lists every metric. The families are kept alive for as long as
their metrics: Triton refuses to update a metric whose family was garbage-collected. Each update is an
IPC round trip from the Python-backend stub to the server, so both classes batch them.
"""

from __future__ import annotations

import time

from specdec import tensor_names as tn

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# Most requests wait for nothing: the first bucket tells those apart from the ones that queued.
QUEUE_BUCKETS = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# A request's time per output token after its first: milliseconds on GPUs, tens of them on CPUs
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
# A request's token counts (prompt, output, max_tokens asked): 1-2-5 steps, as vLLM's histograms of them
TOKEN_BUCKETS = [float(m * 10 ** e) for e in range(6) for m in (1, 2, 5)]


class _Families:
    """Creates metric families and keeps them alive."""

    def __init__(self, pb_utils):
        self.kinds = pb_utils.MetricFamily
        self.families = []

    def __call__(self, name: str, description: str, kind):
        family = self.kinds(name=name, description=description, kind=kind)
        self.families.append(family)
        return family


# One family in every stub that trims (the language models, the orchestrator), labelled with the model's name: a
# family made twice must have the same help text.
HEAP_TRIMS = ("specdec_model_heap_trims_total", "Times the model's stub handed the host memory its ended sequences "
              "and requests freed back to the OS (heap_trim_interval_s)")


class _MetricSet:
    def close(self) -> None:
        """Let go of every metric and family now, while the stub runs (the model's `finalize`): left to the
        stub's exit, their destructors reach the stub being torn down, and every stub with metrics
        segfaulted at each unload (triton-inference-server/server#8662). No update may follow."""
        self.__dict__.clear()


class ModelMetrics(_MetricSet):
    """draft_model's and target_model's metrics, labelled with the model's name."""

    def __init__(self, pb_utils, model_name: str):
        make = self._make = _Families(pb_utils)
        kinds = make.kinds
        labels = {"model": model_name}
        self.tokens = make("specdec_model_tokens_processed_total",
                           "Tokens run through the model's forward pass (prompt, catch-up, draft and verify tokens)",
                           kinds.COUNTER).Metric(labels=labels)
        self.live = make("specdec_model_live_sequences", "Sequences whose KV cache the model currently holds",
                         kinds.GAUGE).Metric(labels=labels)
        self.kv_bytes = make("specdec_model_kv_cache_bytes",
                             "Bytes of KV cache the model's sequences hold (pool blocks, or per-sequence buffers "
                             "grown by doubling)", kinds.GAUGE).Metric(labels=labels)
        self.kv_capacity = make("specdec_model_kv_cache_capacity_bytes",
                                "Bytes of KV cache the model may hold in all (its paged pool; 0: not budgeted, "
                                "per-sequence buffers grow on demand)", kinds.GAUGE).Metric(labels=labels)
        self.forward_seconds = make("specdec_model_forward_seconds_total",
                                    "Seconds spent in the model's forward passes (the rest of an execute is "
                                    "the adapter's own work)", kinds.COUNTER).Metric(labels=labels)
        self.heap_trims = make(*HEAP_TRIMS, kinds.COUNTER).Metric(labels=labels)
        self.prefix_queries = make("specdec_model_prefix_cache_queries_total",
                                   "Prompt tokens of new sequences looked up in the prefix cache",
                                   kinds.COUNTER).Metric(labels=labels)
        self.prefix_hits = make("specdec_model_prefix_cache_hits_total",
                                "Prompt tokens found in the prefix cache (their keys and values reused, not computed)",
                                kinds.COUNTER).Metric(labels=labels)
        self.prefix_bytes = make("specdec_model_prefix_cache_bytes",
                                 "Bytes of KV blocks kept for later prompts that no sequence holds (the static "
                                 "executor's pool blocks, given up whenever room is needed; the eager one's store)",
                                 kinds.GAUGE).Metric(labels=labels)
        ahead = make("specdec_model_run_ahead_steps_total",
                     "Greedy steps run ahead of their requests (run_ahead): used = a request took it, dropped = "
                     "the next request asked for another step", kinds.COUNTER)
        self.ahead = (ahead.Metric(labels={**labels, "outcome": "used"}),
                      ahead.Metric(labels={**labels, "outcome": "dropped"}))
        self.lora_loads = make("specdec_model_lora_loads_total",
                               "LoRA adapters read from lora_directory into a slot (each first request for one "
                               "not held; many: max_loras too few for the traffic's adapters)",
                               kinds.COUNTER).Metric(labels=labels)
        self._tokens, self._at, self._seconds, self._prefix, self._ahead = 0, 0.0, 0.0, (0, 0), (0, 0)
        self._lora_loads = 0
        # A model loaded again after its stub died starts empty: its gauges say so at once, not the dead
        # stub's last values (Triton keeps a family's metrics across the model's instances).
        for gauge in (self.live, self.kv_bytes, self.prefix_bytes):
            gauge.set(0)
        self._gauges: dict[str, float | None] = {"live": 0, "kv": 0, "prefix": 0}

    def report(self, tokens_processed: int, live_sequences: int, kv_bytes: int, flush: bool,
               forward_seconds: float = 0.0, prefix: tuple[int, int] = (0, 0), prefix_bytes: int = 0,
               ahead: tuple[int, int] = (0, 0), lora_loads: int = 0) -> None:
        """Set the gauges only when they changed, and add to the counters at most twice a second or when
        a sequence ends (flush): this runs on every execute. Counts are totals since load; `prefix` is
        (prompt tokens looked up, found) in the prefix cache, `prefix_bytes` what it keeps, `ahead` (steps
        run ahead used, dropped), `lora_loads` the LoRA adapters read on demand."""
        now = time.monotonic()
        pending = tokens_processed - self._tokens
        if pending and (flush or now - self._at >= 0.5):
            self.tokens.increment(pending)
            self.forward_seconds.increment(forward_seconds - self._seconds)
            self._tokens, self._at, self._seconds = tokens_processed, now, forward_seconds
            if prefix != self._prefix:
                self.prefix_queries.increment(prefix[0] - self._prefix[0])
                self.prefix_hits.increment(prefix[1] - self._prefix[1])
                self._prefix = prefix
            if ahead != self._ahead:
                for metric, now_count, before in zip(self.ahead, ahead, self._ahead):
                    if now_count != before:
                        metric.increment(now_count - before)
                self._ahead = ahead
            if lora_loads != self._lora_loads:
                self.lora_loads.increment(lora_loads - self._lora_loads)
                self._lora_loads = lora_loads
        for key, metric, value in (("live", self.live, live_sequences), ("kv", self.kv_bytes, kv_bytes),
                                   ("prefix", self.prefix_bytes, prefix_bytes)):
            if value != self._gauges[key]:
                metric.set(value)
                self._gauges[key] = value


class HostedHeadMetrics(_MetricSet):
    """target_model's hosted heads (engine/hosted_heads.py): each head's drafting, which the model's forward
    seconds leave out, labelled with the model and the head's name."""

    FIELDS = ("seconds", "proposals", "tokens", "failures")  # HeadTotals' fields, in the order of the families

    def __init__(self, pb_utils, model_name: str, heads: list[str]):
        make = self._make = _Families(pb_utils)
        counter = make.kinds.COUNTER
        families = [
            make("specdec_hosted_head_seconds_total", "Seconds a head hosted in the target's process spent "
                 "drafting (its forwards and picks, before the verify's forward)", counter),
            make("specdec_hosted_head_proposals_total", "Proposals asked of a hosted head (one per sequence and "
                 "round it drafted for)", counter),
            make("specdec_hosted_head_draft_tokens_total", "Tokens a hosted head drafted", counter),
            make("specdec_hosted_head_failures_total", "A hosted head's drafting calls that raised (their rounds "
                 "verified nothing drafted; the log has the error)", counter)]
        self.metrics = {head: [family.Metric(labels={"model": model_name, "head": head}) for family in families]
                        for head in heads}
        self._sent = {head: (0.0, 0, 0, 0) for head in heads}
        self._at = 0.0

    def report(self, totals: dict, flush: bool) -> None:
        """totals: head -> HeadTotals (totals since load); sent at most twice a second, or now with flush."""
        now = time.monotonic()
        if not flush and now - self._at < 0.5:
            return
        self._at = now
        for head, total in totals.items():
            values = tuple(getattr(total, field) for field in self.FIELDS)
            for metric, value, sent in zip(self.metrics[head], values, self._sent[head]):
                if value != sent:
                    metric.increment(value - sent)
            self._sent[head] = values


class SkipMetrics(_MetricSet):
    """A layer-skip self-draft's search (skip_layers.SkipTuner): the set it drafts with, as one gauge per
    layer, its trials and the speedup it expects of the set."""

    def __init__(self, pb_utils, model_name: str, layers: int):
        make = self._make = _Families(pb_utils)
        kinds = make.kinds
        family = make("specdec_draft_layer_skipped", "1 where the layer-skip draft leaves the layer out of the "
                      "sequences it starts now, 0 where it runs it", kinds.GAUGE)
        self.layers = [family.Metric(labels={"model": model_name, "layer": str(i)}) for i in range(layers)]
        labels = {"model": model_name}
        self.trials = make("specdec_draft_skip_trials_total", "Layer sets the layer-skip draft's search has measured",
                           kinds.COUNTER).Metric(labels=labels)
        self.speedup = make("specdec_draft_skip_estimated_speedup", "The speedup the search expects of the set in "
                            "use, from its agreement with the whole model and its cost", kinds.GAUGE).Metric(labels=labels)
        self._trials, self._skip = 0, None

    def report(self, skip: tuple[int, ...], trials: int, speedup: float) -> None:
        if skip != self._skip:
            for i, gauge in enumerate(self.layers):
                gauge.set(int(i in skip))
            self._skip = skip
        if trials > self._trials:
            self.trials.increment(trials - self._trials)
            self._trials = trials
        self.speedup.set(speedup)


class OrchestratorMetrics(_MetricSet):
    """The orchestrator's metrics. Every instance of the model (a stub process each) updates the same
    counters and histograms, which add up; a gauge of one instance's state carries `instance`."""

    def __init__(self, pb_utils, max_num_draft_tokens: int, instance: str = "", model: str = tn.SPECULATIVE_DECODING):
        make = self._make = _Families(pb_utils)
        family = make.kinds
        mine = {"instance": instance}
        self.heap_trims = make(*HEAP_TRIMS, family.COUNTER).Metric(labels={"model": model})
        self.suffix_tokens = make("specdec_suffix_cache_tokens", "Tokens of earlier requests this instance keeps for "
                                  "the suffix draft (at most suffix_cache_tokens; ~20 bytes each with the index)",
                                  family.GAUGE).Metric(labels=mine)

        self.drafted = make("specdec_draft_tokens_total", "Draft tokens sent to verification",
                            family.COUNTER).Metric(labels={})
        self.accepted = make("specdec_accepted_draft_tokens_total", "Draft tokens accepted by the target",
                             family.COUNTER).Metric(labels={})
        self.rounds = make("specdec_rounds_total", "Propose/verify rounds (target forward passes)",
                           family.COUNTER).Metric(labels={})
        self.output_tokens = make("specdec_output_tokens_total", "Tokens returned to clients",
                                  family.COUNTER).Metric(labels={})
        self.prompt_tokens = make("specdec_prompt_tokens_total", "Prompt tokens of the requests that finished",
                                  family.COUNTER).Metric(labels={})
        self.tree_rounds = make("specdec_tree_rounds_total", "Rounds that verified a token tree (its nodes count as "
                                "drafted tokens, its depths as the positions drafted)", family.COUNTER).Metric(labels={})
        accepted_len = make("specdec_accepted_length", "Draft tokens accepted per round (rounds that drafted)",
                            family.HISTOGRAM)
        self.accepted_length = accepted_len.Metric(labels={}, buckets=[float(i) for i in range(max_num_draft_tokens + 1)])
        positions = range(1, max_num_draft_tokens + 1)
        drafted_at = make("specdec_drafted_at_position_total",
                          "Rounds that drafted a token at this position (1-based)", family.COUNTER)
        accepted_at = make("specdec_accepted_at_position_total",
                           "Rounds whose draft token at this position was accepted; / drafted = per-position acceptance",
                           family.COUNTER)
        self.drafted_at = {i: drafted_at.Metric(labels={"position": str(i)}) for i in positions}
        self.accepted_at = {i: accepted_at.Metric(labels={"position": str(i)}) for i in positions}
        self.ttft = make("specdec_time_to_first_token_seconds", "Request arrival to its first response",
                         family.HISTOGRAM).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.latency = make("specdec_request_latency_seconds", "Request arrival to its final response",
                            family.HISTOGRAM).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.tpot = make("specdec_time_per_output_token_seconds", "A request's first generated token to its last, "
                         "per token after the first (requests of two tokens or more)",
                         family.HISTOGRAM).Metric(labels={}, buckets=TPOT_BUCKETS)
        self.inter_token = make("specdec_inter_token_latency_seconds", "A request's time from one response's tokens "
                                "to the next's: one observation per round after its first tokens (a round's tokens "
                                "come together)", family.HISTOGRAM).Metric(labels={}, buckets=TPOT_BUCKETS)
        self.phases = {name: make(f"specdec_request_{name}_seconds", text, family.HISTOGRAM).Metric(
            labels={}, buckets=LATENCY_BUCKETS) for name, text in (
                ("prefill", "A request's start of generating (its slot and KV room taken) to its first token"),
                ("decode", "A request's first generated token to its last"),
                ("inference", "A request's start of generating to its last token (prefill + decode)"))}
        self.sizes = {name: make(f"specdec_request_{name}", text, family.HISTOGRAM).Metric(
            labels={}, buckets=TOKEN_BUCKETS) for name, text in (
                ("prompt_tokens", "Prompt tokens of each finished request"),
                ("output_tokens", "Tokens returned to each finished request"),
                ("max_tokens", "The max_tokens of each finished request"))}
        self.queue_time = make("specdec_queue_time_seconds", "Time a request waited for a generation slot "
                               "(max_live_sequences) and for room in target_model's KV cache",
                               family.HISTOGRAM).Metric(labels={}, buckets=QUEUE_BUCKETS)
        self.live = make(tn.LIVE_SEQUENCES, "Requests currently generating in this instance",
                         family.GAUGE).Metric(labels=mine)
        self.heartbeats = make(tn.ORCHESTRATOR_HEARTBEATS, "Turns of this instance's event loop, one a second from its "
                               "first request (the launcher's watchdog restarts the server when an instance with "
                               "requests generating stops counting)", family.COUNTER).Metric(labels=mine)
        self.live_peak = make("specdec_live_sequences_peak", "The most requests that have generated at once in the "
                              "server, as far as this instance has seen (the highest live-sequence slot it took)",
                              family.GAUGE).Metric(labels=mine)
        self._live_peak = 0
        self.queued = make("specdec_queued_requests", "Requests waiting in this instance for a slot "
                           "(max_live_sequences reached) or for room in target_model's KV cache",
                           family.GAUGE).Metric(labels=mine)
        # The server-wide cap: every instance sets the same value, so it carries no instance label.
        self.max_live = make("specdec_max_live_sequences", "Requests that may generate at once (max_live_sequences)",
                             family.GAUGE).Metric(labels={})
        self.sequences_per_forward = make(
            "specdec_sequences_per_forward", "Sequences sharing a target forward (moving average; the policy's n)",
            family.GAUGE).Metric(labels=mine)
        verify_cost = make("specdec_verify_cost", "v(k): a round drafting k tokens, in target-only steps, as "
                           "the adaptive policy currently estimates it", family.GAUGE)
        self.verify_cost = {k: verify_cost.Metric(labels={"draft_tokens": str(k), **mine}) for k in positions}
        self.fallbacks = make("specdec_draft_fallbacks_total", "Rounds run target-only because their draft model "
                              "failed or was out of rotation after failing", family.COUNTER)
        self._fallback_metrics: dict = {}
        self.load_limited = make("specdec_load_limited_rounds_total", "Rounds run target-only because more requests "
                                 "than max_drafting_sequences were generating", family.COUNTER).Metric(labels={})
        self.gate_holds = make("specdec_verify_gate_holds_total", "Verify calls that waited at the gate for other "
                               "requests' (verify_gather_ms)", family.COUNTER).Metric(labels={})
        self.call_timeouts = make(tn.MODEL_CALL_TIMEOUTS, "Calls to a model it did not answer within model_call_timeout_s "
                                  "(the launcher's watchdog then restarts the model)", family.COUNTER)
        self._timeout_metrics: dict = {}
        self._costs_published = 0.0
        self._flushed = 0.0
        self._reset_pending()
        for gauge in (self.live, self.live_peak, self.queued):  # a reloaded instance starts at 0 (ModelMetrics)
            gauge.set(0)
        requests = make("specdec_requests_total", "Finished requests by finish reason", family.COUNTER)
        self.requests = {reason: requests.Metric(labels={"finish_reason": reason})
                         for reason in ("length", "stop", "cancelled", "error", "invalid", "rejected")}
        # Per LoRA adapter (lora_name): its traffic, and what the drafts (the base model's) get accepted under it
        self._lora_families = tuple(make(name, text, family.COUNTER) for name, text in (
            ("specdec_lora_requests_total", "Finished requests that ran a LoRA adapter, by adapter"),
            ("specdec_lora_output_tokens_total", "Tokens returned to requests that ran a LoRA adapter, by adapter"),
            ("specdec_lora_draft_tokens_total", "Draft tokens verified for requests that ran a LoRA adapter"),
            ("specdec_lora_accepted_draft_tokens_total", "Of those, accepted by the adapted target")))
        self._lora_metrics: dict[str, tuple] = {}

    def record_round(self, drafted: int, accepted: int, now: float, depth: int | None = None,
                     gap_s: float | None = None) -> None:
        """Count a round locally; `flush` sends the totals. Every metric update is an IPC round trip from
        the Python-backend stub to the server, and a round with K = 16 touches ~35 metrics: done per
        round, that cost more than the rounds' own bookkeeping (a serving overhead speculation pays
        on every round). A tree of `drafted` nodes counts its depths as the positions drafted; `gap_s`: the
        time since the request's previous tokens (None: these are its first, or it generated none)."""
        self._pending_rounds += 1
        if gap_s is not None:
            self._pending_gaps.append(gap_s)
        if drafted:
            self._pending_drafted += drafted
            self._pending_lengths.append(accepted)
            if depth is not None:
                self._pending_trees += 1
            for i in range(drafted if depth is None else depth):
                self._pending_drafted_at[i] += 1
            for i in range(accepted):
                self._pending_accepted_at[i] += 1
        if now - self._flushed >= 0.5:
            self.flush(now)

    def flush(self, now: float) -> None:
        """Send the rounds counted since the last flush (twice a second, and before a final response)."""
        self._flushed = now
        if self._pending_rounds:
            self.rounds.increment(self._pending_rounds)
        if self._pending_drafted:
            self.drafted.increment(self._pending_drafted)
            self.accepted.increment(sum(self._pending_accepted_at))
        if self._pending_trees:
            self.tree_rounds.increment(self._pending_trees)
        for length in self._pending_lengths:
            self.accepted_length.observe(float(length))
        for gap in self._pending_gaps:
            self.inter_token.observe(gap)
        for counts, metrics in ((self._pending_drafted_at, self.drafted_at), (self._pending_accepted_at, self.accepted_at)):
            for i, count in enumerate(counts):
                if count:
                    metrics[i + 1].increment(count)
        for name, count in self._pending_fallbacks.items():
            if name not in self._fallback_metrics:
                self._fallback_metrics[name] = self.fallbacks.Metric(labels={"draft_model": name})
            self._fallback_metrics[name].increment(count)
        if self._pending_holds:
            self.gate_holds.increment(self._pending_holds)
        if self._pending_limited:
            self.load_limited.increment(self._pending_limited)
        self._reset_pending()

    def record_call_timeout(self, model: str) -> None:
        """A call `model` did not answer in time: sent at once (the watchdog acts on it, and it is rare)."""
        if model not in self._timeout_metrics:
            self._timeout_metrics[model] = self.call_timeouts.Metric(labels={"model": model})
        self._timeout_metrics[model].increment(1)

    def record_fallback(self, draft_name: str) -> None:
        """A round that ran target-only because its draft failed (sent with the next flush)."""
        self._pending_fallbacks[draft_name] = self._pending_fallbacks.get(draft_name, 0) + 1

    def record_load_limited(self) -> None:
        """A round made target-only by max_drafting_sequences (sent with the next flush)."""
        self._pending_limited += 1

    def record_gate_hold(self) -> None:
        """A verify call that waited at the gate (sent with the next flush)."""
        self._pending_holds += 1

    def _reset_pending(self) -> None:
        self._pending_rounds = 0
        self._pending_drafted = 0
        self._pending_trees = 0
        self._pending_holds = 0
        self._pending_limited = 0
        self._pending_lengths: list[int] = []
        self._pending_gaps: list[float] = []
        self._pending_drafted_at = [0] * len(self.drafted_at)
        self._pending_accepted_at = [0] * len(self.accepted_at)
        self._pending_fallbacks: dict[str, int] = {}

    def record_costs(self, costs, now: float) -> None:
        """Publish the policy's cost estimates (CostModel), at most twice a second."""
        if now - self._costs_published < 0.5:
            return
        self._costs_published = now
        if costs.sequences.value is not None:
            self.sequences_per_forward.set(costs.sequences.value)
        for k, metric in self.verify_cost.items():
            metric.set(costs.verify_cost(k))

    def set_live(self, live: int, peak: int) -> None:
        """This instance's live requests, and the server's high-water mark as this instance knows it (a
        mark: a scrape between two samples cannot miss it)."""
        self.live.set(live)
        if peak > self._live_peak:
            self._live_peak = peak
            self.live_peak.set(peak)

    def record_request(self, finish_reason: str, output_tokens: int, latency_s: float, lora_name: str = "",
                       drafted: int = 0, accepted: int = 0, prompt_tokens: int = 0,
                       times: dict[str, float | None] | None = None, max_tokens: int = 0) -> None:
        """A finished request: `times`, its moments (tn.PERF_METRIC_OUTPUTS, time.monotonic(); None: none
        came, as for a request that generated nothing); `max_tokens`, what it asked for (0: a request refused
        or cancelled before it started, counted in no histogram of its sizes)."""
        self.requests[finish_reason].increment(1)
        self.output_tokens.increment(output_tokens)
        if prompt_tokens:
            self.prompt_tokens.increment(prompt_tokens)
        self.latency.observe(latency_s)
        if max_tokens:
            for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens),
                                ("max_tokens", max_tokens)):
                self.sizes[name].observe(value)
        times = times or {}
        started, first, last = (times.get(name) for name in (tn.FIRST_SCHEDULED_TIME_NS, tn.FIRST_TOKEN_TIME_NS,
                                                             tn.LAST_TOKEN_TIME_NS))
        if first is not None and last is not None:
            self.phases["decode"].observe(last - first)
            if output_tokens > 1:
                self.tpot.observe((last - first) / (output_tokens - 1))
            if started is not None:
                self.phases["prefill"].observe(first - started)
                self.phases["inference"].observe(last - started)
        if lora_name:
            if lora_name not in self._lora_metrics:
                self._lora_metrics[lora_name] = tuple(family.Metric(labels={"lora_name": lora_name})
                                                      for family in self._lora_families)
            for metric, value in zip(self._lora_metrics[lora_name], (1, output_tokens, drafted, accepted)):
                if value:
                    metric.increment(value)
