"""Reading a server's Prometheus text: what the launcher's drain, the benchmarks and the tests look at."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(metrics_url: str) -> str:
    """The Prometheus text of a metrics endpoint (host:port)."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
        return response.read().decode()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric `name`, as the server spells it."""
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # The parser names every counter sample `..._total`, also Triton's (nv_inference_exec_count).
            if sample.name == name or (family.name == name and sample.name == name + "_total"):
                out.append((sample.labels, sample.value))
    return out


def sum_samples(text: str, name: str, **labels) -> float:
    return sum(value for sample_labels, value in samples(text, name)
               if all(sample_labels.get(k) == str(v) for k, v in labels.items()))
