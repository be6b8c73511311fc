"""bench/gpu_session.sh, the script a lent GPU machine runs: a typo there costs device time, not CI time."""

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_session.sh"


def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_documented_part_is_a_case_and_the_refusal_names_them_all():
    text = SCRIPT.read_text()
    header = text.split("# Parts:", 1)[1].split("# Results:", 1)[0]
    documented = re.findall(r"^#   ([a-z0-9]+)\s{2,}", header, re.MULTILINE)
    cases = re.findall(r"^    ([a-z0-9]+)\)", text, re.MULTILINE)
    assert documented and sorted(documented) == sorted(cases)
    refusal = re.search(r"unknown part: \$part \(([^)]*)\)", text).group(1)
    assert sorted(refusal.split(", ")) == sorted(cases)
    # The suggested commands name real parts only.
    for line in re.findall(r"bash bench/gpu_session\.sh ([a-z0-9 ]+)", text):
        assert set(line.split()) <= set(cases), line


def test_an_ab_part_gives_each_side_its_own_arguments_in_abba_order(tmp_path):
    """`prompts` sets prefill_graph_rows=512 on one side and 0 on the other (512 is the default, so "off"
    must say 0); `maxk`'s off side adds nothing. Run with a stand-in python that logs its arguments."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && {{ echo {tmp_path}; exit 0; }}\necho "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "session"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "HOME": str(tmp_path), "GPU_SESSION_DIR": str(out)}
    result = subprocess.run(["bash", str(SCRIPT), "prompts", "prompts", "maxk"], capture_output=True, text=True,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    order = re.findall(r"^(\S+): exit 0", (out / "summary.txt").read_text(), re.MULTILINE)
    assert order == ["prompts-on-1", "prompts-off-1", "prompts-off-2", "prompts-on-2", "maxk-off-1", "maxk-on-1"]
    logged = {name: (out / f"{name}.log").read_text() for name in order}
    for run in ("1", "2"):
        assert "target_model.prefill_graph_rows=512" in logged[f"prompts-on-{run}"]
        assert "draft_model.prefill_graph_rows=0" in logged[f"prompts-off-{run}"]
        assert "prefill_graph_rows=512" not in logged[f"prompts-off-{run}"]
    assert "--launcher-arg" not in logged["maxk-off-1"]
    assert "--max-num-draft-tokens=16" in logged["maxk-on-1"]


def test_the_fp8_part_serves_with_the_fastest_launch_its_kernel_bench_printed(tmp_path):
    """`fp8` after `tests`: no second FP8 test, the kernel bench, then both servers with SPECDEC_FP8_KERNEL set
    to the launch the bench printed last (FP8 on one side only)."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && {{ echo {tmp_path}; exit 0; }}\n'
                    '[ "$2" = bench.fp8_kernel_bench ] && echo "best: 16,128,4,3,8"\n'
                    'echo "$@" "launch=$SPECDEC_FP8_KERNEL"\n')
    fake.chmod(0o755)
    out = tmp_path / "session"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "HOME": str(tmp_path), "GPU_SESSION_DIR": str(out)}
    result = subprocess.run(["bash", str(SCRIPT), "tests", "fp8"], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    assert re.findall(r"^(\S+): exit 0", summary, re.MULTILINE) == ["tests-gpu", "fp8-kernel", "fp8-on-1", "fp8-off-1"]
    assert "fp8: served with launch 16,128,4,3,8" in summary
    for side in ("on", "off"):
        assert "launch=16,128,4,3,8" in (out / f"fp8-{side}-1.log").read_text()
    assert "--weights-dtype=fp8" in (out / "fp8-on-1.log").read_text()
    assert "--weights-dtype=fp8" not in (out / "fp8-off-1.log").read_text()
