"""`make bench-gpu`'s script in its small CPU mode: builds its pair, times it in process, serves it through
the launcher and prints the whole table (the GPU figures themselves come from a GPU machine)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def bench(name: str) -> list[str]:
    """The command that runs bench/<name>.py: as a module, from the repository's root (`cwd=REPO_ROOT`)."""
    return [sys.executable, "-m", f"bench.{name}"]


def test_gpu_bench_small_mode_prints_every_row(tmp_path):
    out = tmp_path / "table.md"
    result = subprocess.run([*bench("gpu_bench"), "--small", "--compile", "off", "--prompts", "2",
                             "--max-tokens", "12", "--streams", "3", "--long-prompts", "200", "--extra-k", "6",
                             "--drafts", "draft_model:2", "--launcher-arg=--set=speculative_decoding.draft_branches=2",
                             "--traces", str(tmp_path / "traces"), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    table = out.read_text()
    for row in ("weight-streaming bound", "plain PyTorch, static cache", "project executor",
                "served, 1 stream, K=0", "served, 1 stream, K=4", "served, 1 stream, adaptive K<=4",
                "served, 1 stream, K=6", "served, 1 stream, adaptive K<=6",
                "served, 3 streams, K=0", "served, 3 streams, K=4", "served, 3 streams, adaptive K<=4",
                "transformers generate, plain",
                "transformers generate, assisted K=4"):
        assert row in table, row
    # float32: greedy speculative text equals target-only text on every prompt.
    first = re.search(r"\| served, 1 stream, first token alone +\| +([\d.]+) ms", table)
    assert first and float(first.group(1)) > 0, table
    # --long-prompts 200 (default 200 and 480 tokens): a first-token row each, its prompts about that long
    for tokens in (200,):
        row = re.search(rf"\| served, 1 stream, first token alone, {tokens}-token prompts +\| +([\d.]+) ms.*"
                        rf"2 prompts of (\d+)-(\d+) tokens", table)
        assert row and float(row.group(1)) > 0, table
        assert tokens - 8 <= int(row.group(2)) <= int(row.group(3)) <= tokens + 8, row.group(0)
    served = [line for line in table.splitlines() if line.startswith("| served, 1 stream") and "first token" not in line]
    assert len(served) == 7 and all("equal text 100%" in line for line in served)
    # --drafts draft_model:2: the draft named per request, its trees, at K=4 and adaptive beside the same K=0;
    # no bound (the in-process c is the layer-skip draft's chain, not another draft's)
    trees = [line.split("|") for line in served if "draft_model, trees of 2 branches" in line]
    assert len(trees) == 2 and all(not cells[9].strip() for cells in trees), trees
    # the fixed K drafts every round; the adaptive row may draft nothing where this machine's measured costs say
    # drafting does not pay (seen in a CI run: α 0.00, 1.00 tokens a round)
    assert "drafted per round" in next(cells for cells in trees if "K=4" in cells[1])[11], trees
    # --extra-k 6: its rows drafted up to 6 per round, and each has its own bound from its own verify cost
    six = [line.split("|") for line in served if "K=6" in line or "K<=6" in line]
    assert all(float(cells[9]) > 0 for cells in six), six
    # Streamed (the default): every served row's median TTFT and ITL; the first token alone has neither.
    streamed = served + [line for line in table.splitlines() if line.startswith("| served, ") and " streams" in line]
    latencies = [[float(cell) for cell in line.split("|")[7:9]] for line in streamed]
    assert len(latencies) == 10 and all(ttft > 0 and itl > 0 for ttft, itl in latencies), streamed
    # 3 streams (--streams): how many sequences a target forward carried and how busy the target was,
    # the same of the draft where one drafted, and what a round drafted and yielded.
    many = [line for line in table.splitlines() if line.startswith("| served, 3 streams")]
    busy = [re.search(r"target: [\d.]+ sequences per forward, in forwards (\d+)% of the time, in execute (\d+)%",
                      line) for line in many]
    assert len(many) == 3 and all(match and 0 < int(match.group(1)) <= 100 for match in busy), many
    # execute holds the forward: its share is at least the forwards' (each printed to 1 %)
    assert all(int(match.group(1)) <= int(match.group(2)) + 1 <= 102 for match in busy), many
    fixed = [line for line in many if "streams, K=4 " in line]
    drafted = [re.search(r"([\d.]+) drafted per round; .*draft: [\d.]+ sequences per forward", line) for line in fixed]
    assert len(fixed) == 1 and all(match and 0 < float(match.group(1)) <= 4 for match in drafted), fixed
    assert all(" 0.00 drafted per round" in line and "draft:" not in line for line in many if "K=0" in line), many
    # With the in-process costs: how much of the time the forwards would fill alone, and how much longer
    # each model was in forwards served (the draft's too where one drafted).
    shared = [re.search(r"alone the forwards would fill (\d+)% of the time, served they took target ([\d.]+)x"
                        r"(, draft ([\d.]+)x)? as long", line) for line in many]
    assert all(match and int(match.group(1)) > 0 and float(match.group(2)) > 0 for match in shared), many
    # the draft's share where the row drafts: K=4 always, K=0 never; the adaptive row as its policy chose
    # (under load on 2 cores it may draft nothing at 3 streams)
    assert all(bool(match.group(3)) == ("K=4 " in line) for match, line in zip(shared, many)
               if "adaptive" not in line), many
    # --traces: a client's profile over one stream at K=0 and K=4 after the rows, each model's trace summarised
    traced = table.split("## Traces: one stream at K=0 and K=4", 1)[-1]
    for model in ("target_model", "draft_model"):
        (path,) = (tmp_path / "traces").glob(f"*-{model}-*.trace.json.gz")
        assert re.search(rf"### {re.escape(path.name)}\n\n\d+ executions", traced), traced[:2000]
    # (which operators: whether the project's own CPU kernels, no aten operators, were built on the machine)
    assert traced.count("torch's CPU operators, by self time:\n\n| | calls | ms |") == 2, traced[:2000]


def test_round_overhead_bench_splits_a_round(tmp_path):
    """On the synthetic pair's small twin (`--pair small`: the code path of the GPU's `--pair 8b`; the
    default tiny pair differs only in the paths it passes the launcher)."""
    out = tmp_path / "overhead.md"
    result = subprocess.run([*bench("round_overhead"), "--pair", "small", "--repeats", "1", "--max-tokens", "16",
                             "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "cpu, synthetic small pair (float32), greedy" in out.read_text()
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| K=")]
    for k in ("K=0", "K=4"):
        mine = {row[2].strip(): float(row[3]) for row in rows if row[1].strip() == k}
        assert mine["target_model forward"] > 0 and mine["round (client wall time / rounds)"] > 0
        split = {name: value for name, value in mine.items() if not name.startswith(("round", "CPU time"))}
        # the parts of the wall time add up to the round (each printed to 0.01 ms)
        assert abs(sum(split.values()) - mine["round (client wall time / rounds)"]) <= 0.005 * (len(split) + 1)
        forwards = sum(value for name, value in split.items() if name.endswith(" forward"))
        machinery = mine["round minus the forwards: the serving machinery"]
        assert abs(machinery - (mine["round (client wall time / rounds)"] - forwards)) <= 0.02 and machinery > 0
        # and each server process's CPU time per round is there beside them (Linux /proc)
        assert mine["CPU time: speculative_decoding"] > 0 and mine["CPU time: target_model"] > 0
        assert mine["CPU time: tritonserver"] > 0
    assert any(row[2].strip() == "draft_model forward" for row in rows if row[1].strip() == "K=4")


def test_round_overhead_bench_refuses_the_8b_pair_on_cpu_top_p_without_sampling_and_a_paused_draft_unnamed():
    result = subprocess.run([*bench("round_overhead"), "--pair", "8b"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2 and "--pair 8b needs --device gpu" in result.stderr
    result = subprocess.run([*bench("round_overhead"), "--top-p", "0.9"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2 and "--top-p applies to sampled rounds" in result.stderr
    result = subprocess.run([*bench("round_overhead"), "--paused-draft"], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 2 and "--paused-draft names --draft" in result.stderr


def test_executor_bench_compares_the_executors_on_the_tiny_pair(tmp_path):
    import torch

    from specdec.engine import panel_linear

    kernels = ["torch"] + (["panels"] if panel_linear.available(torch.device("cpu"), torch.float32) is None else [])
    out = tmp_path / "executor.md"
    result = subprocess.run([*bench("executor_bench"), "--pair", "tiny", "--reps", "2", "--batch", "2",
                             "--linear-kernels", ",".join(kernels), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    table = out.read_text()
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| target")]
    assert [(row[2].strip(), row[3].strip()) for row in rows] == [(mode, kind) for kind in kernels
                                                                  for mode in ("dynamic", "off")]
    # every executor's logits, on either kernels, equal the first (dynamic, torch's kernels) to float32
    # rounding: the static executor's CPU layer kernels sum in their own order (logits up to ~20 here)
    assert all(float(row[-2]) < 5e-4 for row in rows), table + result.stderr[-4000:]


def test_concurrency_bench_compares_orchestrator_counts(tmp_path):
    """`loadtest/concurrency_bench.py --compare-orchestrators 1 2`: a server per count, both serving, one table."""
    script = REPO_ROOT / "loadtest" / "concurrency_bench.py"
    result = subprocess.run([sys.executable, str(script), "--pair", "tiny", "--compare-orchestrators", "1", "2",
                             "--concurrency", "2", "--requests-per-level", "2", "--max-tokens", "8",
                             "--num-draft-tokens", "3"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0]]
    assert header[2:5] == ["1 orchestrator tokens/s", "2 orchestrators tokens/s", "2 orchestrators / 1 orchestrator"]
    rows = {row[1].strip(): row for row in lines[2:] if row[0].strip() == "2"}
    assert set(rows) == {"target-only", "speculative"}
    for row in rows.values():
        one, two, ratio = float(row[2]), float(row[3]), float(row[4].strip().rstrip("x"))
        assert one > 0 and two > 0 and ratio == pytest.approx(two / one, abs=0.01)


def test_structured_bench_runs_every_mode_with_equal_text(tmp_path):
    """`make bench-structured` on the tiny pair: every schema, whitespace setting and proposal mode, the text
    the same in all three, and forced text proposed (rounds fewer than tokens) where the JSON is compact."""
    out = tmp_path / "structured.md"
    result = subprocess.run([*bench("structured_bench"), "--pair", "tiny",
                             "--max-tokens", "16", "--repeats", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| schema", "| ---"))]
    assert len(rows) == 12 and all(row[-1] == "yes" for row in rows)
    forced = [row for row in rows if row[1] == "compact" and row[2] == "lookup + forced"]
    assert forced and all(int(row[4]) < int(row[3]) for row in forced)

