"""Locust headless with the standard command line against the tiny-pair server; reads its CSV statistics."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


def run_locust(tmp_path, host, seconds=20):
    prefix = tmp_path / "stats"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4",
             "-t", f"{seconds}s", "--stop-timeout", "30", "--host", host, "--csv", str(prefix),
             "--max-tokens", "24"],
            capture_output=True, text=True, timeout=seconds + 90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"locust did not stop:\n{(exc.stdout or b'')[-3000:]}\n{(exc.stderr or b'')[-3000:]}")
    rows = list(csv.DictReader(open(f"{prefix}_stats.csv")))
    return out, {(row["Type"], row["Name"]): row for row in rows}


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_locust_headless_records_requests_and_ttft(server, tmp_path, scheme):
    host = server.grpc_url if scheme == "grpc" else server.http_url
    out, rows = run_locust(tmp_path, host)
    assert out.returncode == 0, out.stderr[-3000:]
    generate = rows[(scheme, "generate")]
    assert int(generate["Request Count"]) > 0
    assert int(generate["Failure Count"]) == 0
    ttft = rows[(scheme, "ttft")]
    assert int(ttft["Request Count"]) > 0 and float(ttft["Median Response Time"]) > 0
    assert (scheme, "itl") in rows
    summary = out.stdout + out.stderr
    for line in ("requests", "failures", "TTFT p50/p90/p99", "ITL p50/p90", "output tokens/s", "mean acceptance"):
        assert line in summary
