"""The server's metrics under vLLM's names, on the OpenAI API's /metrics beside the API's own, as `vllm serve`
exports them on its API port: what dashboards built for vLLM, autoscalers (KEDA, HPA on
`vllm:num_requests_waiting`) and the Kubernetes Gateway API Inference Extension's endpoint picker (queue, KV
cache use) read from a vLLM server read here too.

Each scrape of the API's /metrics reads the server's Prometheus text (Triton's metrics port) and restates:

| vLLM's | from the server's |
| --- | --- |
| `vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges) | `specdec_live_sequences`, `specdec_queued_requests`, summed over orchestrator instances |
| `vllm:kv_cache_usage_perc` (gauge, 0-1) | target_model's `specdec_model_kv_cache_bytes` over its `..._capacity_bytes` (only with a budgeted pool: the static executor's) |
| `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | `specdec_prompt_tokens_total`, `specdec_output_tokens_total` |
| `vllm:request_success_total{finished_reason}` | `specdec_requests_total{finish_reason}`: stop, length; cancelled as abort |
| `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` | target_model's `specdec_model_prefix_cache_*_total` (tokens) |
| `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}` (0-based) | rounds that drafted (`specdec_accepted_length`'s count), `specdec_draft_tokens_total`, `specdec_accepted_draft_tokens_total`, `specdec_accepted_at_position_total` (1-based) |
| `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`, `vllm:request_time_per_output_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`, `vllm:request_inference_time_seconds` (histograms) | `specdec_time_to_first_token_seconds`, `specdec_request_latency_seconds`, `specdec_queue_time_seconds`, `specdec_time_per_output_token_seconds`, `specdec_inter_token_latency_seconds`, `specdec_request_prefill_seconds`, `..._decode_seconds`, `..._inference_seconds` (the server's buckets) |
| `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_max_num_generation_tokens`, `vllm:request_params_max_tokens` (histograms) | `specdec_request_prompt_tokens`, `specdec_request_output_tokens` (both generation ones: a request is one sequence), `specdec_request_max_tokens` |

With LoRA adapters served, `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}` (the
inference gateway's LoRA affinity): the adapters this API's generations run now (the ones waiting for a slot
count as running: the server does not tell them apart here; `waiting_lora_adapters` stays empty) and the
target's adapter slots, valued at the scrape's time as vLLM values it at its last change.

Every other family carries `model_name` (the first served name), as vLLM's do. Pure: Prometheus text in, text out.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from specdec import tensor_names as tn

TARGET = "target_model"  # the model whose KV cache and prefix cache vLLM's figures describe
GAUGES = (("vllm:num_requests_running", tn.LIVE_SEQUENCES, "Requests generating now"),
          ("vllm:num_requests_waiting", "specdec_queued_requests", "Requests waiting for a slot or KV room"))
COUNTERS = (("vllm:prompt_tokens", "specdec_prompt_tokens", {}, "Prompt tokens of finished requests"),
            ("vllm:generation_tokens", "specdec_output_tokens", {}, "Tokens generated"),
            ("vllm:prefix_cache_queries", "specdec_model_prefix_cache_queries", {"model": TARGET},
             "Prompt tokens looked up in the prefix cache"),
            ("vllm:prefix_cache_hits", "specdec_model_prefix_cache_hits", {"model": TARGET},
             "Prompt tokens found in the prefix cache"),
            ("vllm:spec_decode_num_draft_tokens", "specdec_draft_tokens", {}, "Draft tokens verified"),
            ("vllm:spec_decode_num_accepted_tokens", "specdec_accepted_draft_tokens", {}, "Draft tokens accepted"))
HISTOGRAMS = (("vllm:time_to_first_token_seconds", "specdec_time_to_first_token_seconds", "Time to first token"),
              ("vllm:e2e_request_latency_seconds", "specdec_request_latency_seconds", "Request latency"),
              ("vllm:request_queue_time_seconds", "specdec_queue_time_seconds", "Time waiting for a slot"),
              ("vllm:request_time_per_output_token_seconds", "specdec_time_per_output_token_seconds",
               "A request's time per output token after its first"),
              # (vLLM observes each step's gap per request, its steps' tokens together, as a round's are here)
              ("vllm:inter_token_latency_seconds", "specdec_inter_token_latency_seconds", "Time between a "
               "request's successive tokens (a round's come together)"),
              ("vllm:request_prefill_time_seconds", "specdec_request_prefill_seconds", "Start of generating to the "
               "first token"),
              ("vllm:request_decode_time_seconds", "specdec_request_decode_seconds", "First token to the last"),
              ("vllm:request_inference_time_seconds", "specdec_request_inference_seconds", "Start of generating to "
               "the last token"),
              ("vllm:request_prompt_tokens", "specdec_request_prompt_tokens", "Prompt tokens per request"),
              ("vllm:request_generation_tokens", "specdec_request_output_tokens", "Generated tokens per request"),
              # (a request of the server's is one sequence: its group's longest is itself)
              ("vllm:request_max_num_generation_tokens", "specdec_request_output_tokens",
               "Generated tokens of a request's longest sequence"),
              ("vllm:request_params_max_tokens", "specdec_request_max_tokens", "The max_tokens of each request"))
FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort"}  # the server's reasons as vLLM names them


def page(server_text: str, model_name: str, lora: tuple[list[str], int] | None = None) -> bytes:
    """vLLM's families, as Prometheus text, from the server's metrics text; `lora`: the adapters the API's
    generations run now and the target's adapter slots, as `vllm:lora_requests_info` (None: no adapters served)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Restated(samples(server_text), model_name, lora))
    return generate_latest(registry)


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the text by its name (counters under `..._total`, histograms' `_bucket`, `_sum`,
    `_count`)."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


class _Restated:
    def __init__(self, samples: dict, model_name: str, lora: tuple[list[str], int] | None):
        self.samples, self.model, self.lora = samples, model_name, lora

    def _sum(self, name: str, **labels) -> float | None:
        found = [value for got, value in self.samples.get(name, []) if all(got.get(k) == v for k, v in labels.items())]
        return sum(found) if found else None

    def collect(self):
        model = {"model_name": self.model}
        for name, source, doc in GAUGES:
            value = self._sum(source)
            if value is not None:
                yield _gauge(name, doc, model, value)
        used, capacity = (self._sum(f"specdec_model_kv_cache{kind}bytes", model=TARGET) for kind in ("_", "_capacity_"))
        if used is not None and capacity:
            yield _gauge("vllm:kv_cache_usage_perc", "KV cache use, 1 = full", model, min(used / capacity, 1.0))
        for name, source, labels, doc in COUNTERS:
            value = self._sum(source + "_total", **labels)
            if value is not None:
                yield _counter(name, doc, model, value)
        finished = CounterMetricFamily("vllm:request_success", "Finished requests, by reason",
                                       labels=["model_name", "finished_reason"])
        for reason, vllm_reason in FINISHED.items():
            value = self._sum("specdec_requests_total", finish_reason=reason)
            if value is not None:
                finished.add_metric([self.model, vllm_reason], value)
        yield finished
        drafts = self._sum("specdec_accepted_length_count")
        if drafts is not None:
            yield _counter("vllm:spec_decode_num_drafts", "Rounds that drafted", model, drafts)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted draft tokens at each position (0-based)",
                                           labels=["model_name", "position"])
        for labels, value in sorted(self.samples.get("specdec_accepted_at_position_total", []),
                                    key=lambda sample: int(sample[0].get("position", 0))):
            per_position.add_metric([self.model, str(int(labels["position"]) - 1)], value)
        yield per_position
        if self.lora is not None:  # what the inference gateway's LoRA affinity reads: the value is when it was true
            running, slots = self.lora
            info = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the requests running now",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(slots), ",".join(running), ""], time.time())
            yield info
        for name, source, doc in HISTOGRAMS:
            counts: dict[str, float] = {}
            for labels, value in self.samples.get(source + "_bucket", []):
                counts[labels["le"]] = counts.get(labels["le"], 0.0) + value
            total = self._sum(source + "_sum")
            if counts and total is not None:
                family = HistogramMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model], sorted(counts.items(), key=lambda bucket: float(bucket[0])), total)
                yield family


def _gauge(name: str, doc: str, labels: dict, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, doc: str, labels: dict, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family
