"""`make bench-gpu`'s script in its small CPU mode: builds its pair, times it in process, serves it through
the launcher and prints the whole table (the GPU figures themselves come from a GPU machine)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_bench.py"


def test_gpu_bench_small_mode_prints_every_row(tmp_path):
    out = tmp_path / "table.md"
    result = subprocess.run([sys.executable, str(SCRIPT), "--small", "--compile", "off", "--prompts", "2",
                             "--max-tokens", "12", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    table = out.read_text()
    for row in ("weight-streaming bound", "plain PyTorch, static cache", "project executor",
                "served, 1 stream, K=0", "served, 1 stream, K=4", "served, 1 stream, adaptive K<=4",
                "served, 8 streams, K=0", "served, 8 streams, adaptive K<=4", "transformers generate, plain",
                "transformers generate, assisted K=4"):
        assert row in table, row
    # float32: greedy speculative text equals target-only text on every prompt.
    served = [line for line in table.splitlines() if line.startswith("| served, 1 stream")]
    assert len(served) == 3 and all("equal text 100%" in line for line in served)
