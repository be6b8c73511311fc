"""Reading a server's Prometheus text (what benchmarks and tests compare)."""

from specdec.serving.metrics_text import sum_samples


def test_metric_samples_are_read_as_the_server_spells_them():
    text = "\n".join([
        "# TYPE nv_inference_exec_count counter",
        'nv_inference_exec_count{model="target_model",version="1"} 5',
        'nv_inference_exec_count{model="draft_model",version="1"} 7',
        "# TYPE specdec_requests_total counter",
        'specdec_requests_total{finish_reason="length"} 3',
        'specdec_requests_total{finish_reason="stop"} 2',
        "# TYPE specdec_live_sequences gauge",
        "specdec_live_sequences 4",
        "# TYPE specdec_accepted_length histogram",
        'specdec_accepted_length_bucket{le="1.0"} 2',
        'specdec_accepted_length_bucket{le="+Inf"} 6',
        "specdec_accepted_length_count 6",
        "specdec_accepted_length_sum 9",
    ]) + "\n"
    assert sum_samples(text, "nv_inference_exec_count", model="target_model") == 5
    assert sum_samples(text, "nv_inference_exec_count") == 12
    assert sum_samples(text, "specdec_requests_total") == 5
    assert sum_samples(text, "specdec_requests_total", finish_reason="stop") == 2
    assert sum_samples(text, "specdec_live_sequences") == 4
    assert sum_samples(text, "specdec_accepted_length_count") == 6
    assert sum_samples(text, "specdec_absent") == 0
