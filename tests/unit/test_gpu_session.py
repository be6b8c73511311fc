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

