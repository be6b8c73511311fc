"""The server's metrics restated under vLLM's names (gateway/vllm_metrics.py), from a server's Prometheus text."""

from prometheus_client.parser import text_string_to_metric_families

from specdec.gateway import vllm_metrics

SERVER = """# TYPE specdec_live_sequences gauge
specdec_live_sequences{instance="speculative_decoding_0_0"} 2
specdec_live_sequences{instance="speculative_decoding_0_1"} 1
# TYPE specdec_queued_requests gauge
specdec_queued_requests{instance="speculative_decoding_0_0"} 4
specdec_queued_requests{instance="speculative_decoding_0_1"} 0
# TYPE specdec_model_kv_cache_bytes gauge
specdec_model_kv_cache_bytes{model="target_model"} 250
specdec_model_kv_cache_bytes{model="draft_model"} 999
# TYPE specdec_model_kv_cache_capacity_bytes gauge
specdec_model_kv_cache_capacity_bytes{model="target_model"} 1000
specdec_model_kv_cache_capacity_bytes{model="draft_model"} 0
# TYPE specdec_prompt_tokens_total counter
specdec_prompt_tokens_total 120
# TYPE specdec_output_tokens_total counter
specdec_output_tokens_total 64
# TYPE specdec_model_prefix_cache_queries_total counter
specdec_model_prefix_cache_queries_total{model="target_model"} 96
specdec_model_prefix_cache_queries_total{model="draft_model"} 7
# TYPE specdec_model_prefix_cache_hits_total counter
specdec_model_prefix_cache_hits_total{model="target_model"} 32
# TYPE specdec_requests_total counter
specdec_requests_total{finish_reason="stop"} 3
specdec_requests_total{finish_reason="length"} 5
specdec_requests_total{finish_reason="cancelled"} 1
specdec_requests_total{finish_reason="invalid"} 2
# TYPE specdec_draft_tokens_total counter
specdec_draft_tokens_total 40
# TYPE specdec_accepted_draft_tokens_total counter
specdec_accepted_draft_tokens_total 25
# TYPE specdec_accepted_length histogram
specdec_accepted_length_count 10
specdec_accepted_length_sum 25
specdec_accepted_length_bucket{le="+Inf"} 10
# TYPE specdec_accepted_at_position_total counter
specdec_accepted_at_position_total{position="1"} 9
specdec_accepted_at_position_total{position="2"} 7
specdec_accepted_at_position_total{position="10"} 1
# TYPE specdec_time_to_first_token_seconds histogram
specdec_time_to_first_token_seconds_count 9
specdec_time_to_first_token_seconds_sum 0.9
specdec_time_to_first_token_seconds_bucket{le="0.05"} 4
specdec_time_to_first_token_seconds_bucket{le="0.5"} 8
specdec_time_to_first_token_seconds_bucket{le="+Inf"} 9
# TYPE specdec_time_per_output_token_seconds histogram
specdec_time_per_output_token_seconds_count 8
specdec_time_per_output_token_seconds_sum 0.4
specdec_time_per_output_token_seconds_bucket{le="0.04"} 5
specdec_time_per_output_token_seconds_bucket{le="+Inf"} 8
# TYPE specdec_request_output_tokens histogram
specdec_request_output_tokens_count 8
specdec_request_output_tokens_sum 64
specdec_request_output_tokens_bucket{le="10.0"} 7
specdec_request_output_tokens_bucket{le="+Inf"} 8
# TYPE specdec_request_prefill_seconds histogram
specdec_request_prefill_seconds_count 8
specdec_request_prefill_seconds_sum 0.3
specdec_request_prefill_seconds_bucket{le="+Inf"} 8
"""


def read(page: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            assert sample.labels.get("model_name") == "llama", sample
            out[(sample.name, labels)] = sample.value
    return out


def test_the_servers_figures_under_vllms_names():
    got = read(vllm_metrics.page(SERVER, "llama"))
    assert got[("vllm:num_requests_running", ())] == 3 and got[("vllm:num_requests_waiting", ())] == 4
    assert got[("vllm:kv_cache_usage_perc", ())] == 0.25  # the target's pool, not the draft's
    assert got[("vllm:prompt_tokens_total", ())] == 120 and got[("vllm:generation_tokens_total", ())] == 64
    assert (got[("vllm:prefix_cache_queries_total", ())], got[("vllm:prefix_cache_hits_total", ())]) == (96, 32)
    assert {labels: value for (name, labels), value in got.items() if name == "vllm:request_success_total"} == {
        (("finished_reason", "stop"),): 3, (("finished_reason", "length"),): 5, (("finished_reason", "abort"),): 1}
    assert (got[("vllm:spec_decode_num_drafts_total", ())], got[("vllm:spec_decode_num_draft_tokens_total", ())],
            got[("vllm:spec_decode_num_accepted_tokens_total", ())]) == (10, 40, 25)
    assert {labels: value for (name, labels), value in got.items()
            if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"} == {
        (("position", "0"),): 9, (("position", "1"),): 7, (("position", "9"),): 1}  # 0-based, as vLLM counts
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.05"),))] == 4
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 9
    assert (got[("vllm:time_to_first_token_seconds_count", ())], got[("vllm:time_to_first_token_seconds_sum", ())]) \
        == (9, 0.9)
    assert got[("vllm:request_time_per_output_token_seconds_bucket", (("le", "0.04"),))] == 5
    assert got[("vllm:request_time_per_output_token_seconds_count", ())] == 8
    for name in ("vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens"):  # one sequence each
        assert (got[(f"{name}_bucket", (("le", "10.0"),))], got[(f"{name}_sum", ())]) == (7, 64)
    assert got[("vllm:request_prefill_time_seconds_sum", ())] == 0.3


def test_what_the_server_does_not_say_is_left_out():
    """A pool of no budget (the dynamic executor) has no usage share; families the text lacks are not made up."""
    got = read(vllm_metrics.page(SERVER.replace('capacity_bytes{model="target_model"} 1000',
                                                'capacity_bytes{model="target_model"} 0'), "llama"))
    assert ("vllm:kv_cache_usage_perc", ()) not in got
    assert not read(vllm_metrics.page("", "llama"))


def test_the_adapters_running_and_the_slots_as_vllms_lora_requests_info():
    """With adapters served: the adapters the API's generations run now and the target's slots (what the
    inference gateway's LoRA affinity reads); without: no such family. ApiMetrics.counted keeps the count."""
    import asyncio

    from specdec.gateway.metrics import ApiMetrics
    from specdec.gateway.upstream import Piece

    (info,) = [sample for family in text_string_to_metric_families(
        vllm_metrics.page(SERVER, "llama", (["chat-v2", "sql"], 6)).decode())
        for sample in family.samples if sample.name == "vllm:lora_requests_info"]
    assert info.labels == {"max_lora": "6", "running_lora_adapters": "chat-v2,sql",  # (vLLM gives it no model_name)
                           "waiting_lora_adapters": ""} and info.value > 1.7e9  # (a time)
    assert "vllm:lora_requests_info" not in vllm_metrics.page(SERVER, "llama").decode()

    metrics = ApiMetrics()

    async def pieces():
        yield Piece()

    async def run():
        stream = metrics.counted(pieces(), lora="sql")
        first = await anext(stream)
        seen = dict(metrics.lora_running)
        await stream.aclose()
        return first, seen

    first, seen = asyncio.run(run())
    assert isinstance(first, Piece) and seen == {"sql": 1} and metrics.lora_running == {}
