"""bench.ab_bench's arithmetic: each server's rate, B over A, each one's speedup over its own target-only."""

import pytest

from bench import ab_bench


def test_the_report_divides_each_servers_figures_by_its_own():
    settings = [ab_bench.SETTINGS["target-only"], ab_bench.SETTINGS["head-k3"]]

    def agg(a_tokens, a_s, b_tokens, b_s, rounds, equal):
        return {"A": dict(tokens=a_tokens, seconds=a_s, rounds=rounds), "B": dict(tokens=b_tokens, seconds=b_s, rounds=rounds),
                "equal": equal, "requests": 4}

    results = {("open", settings[0].label): agg(100, 2.0, 100, 1.0, 100, 4),   # A 50 tok/s, B 100
               ("open", settings[1].label): agg(100, 1.0, 100, 0.8, 50, 3)}    # A 100, B 125
    text = ab_bench.report(results, settings, {"A": "old", "B": "new"}, 96, 2, 2)
    row = next(line for line in text.splitlines() if line.startswith("| EAGLE-3 head, K=3"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:] == ["100.0", "125.0", "1.25x", "2.00x", "1.25x", "2.00 / 2.00", "3/4"]
    assert "- A: old" in text and "- B: new" in text
    assert "one response a request" in text
    assert "streamed (a response per round)" in ab_bench.report(results, settings, {"A": "a", "B": "b"}, 96, 2, 2,
                                                                stream=True)


def test_environment_settings_are_key_value():
    assert ab_bench._env(["GOMP_SPINCOUNT=3000"])["GOMP_SPINCOUNT"] == "3000"
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ab_bench._env(["GOMP_SPINCOUNT"])


def test_prompts_go_one_at_a_time_or_so_many_at_once_in_turn():
    assert ab_bench.batches(["a", "b", "c"], 1) == [["a"], ["b"], ["c"]]
    assert ab_bench.batches(["a", "b", "c", "d"], 2) == [["a", "b"], ["c", "d"]]
    assert ab_bench.batches(["a", "b"], 3) == [["a", "b", "a"]]  # fewer prompts than streams: round again
    settings = [ab_bench.SETTINGS["target-only"]]
    results = {("open", settings[0].label): {"A": dict(tokens=10, seconds=1.0, rounds=10),
                                             "B": dict(tokens=10, seconds=1.0, rounds=10), "equal": 3, "requests": 3}}
    assert "3 requests at once" in ab_bench.report(results, settings, {"A": "a", "B": "b"}, 96, 1, 1, streams=3)
    assert "one request at a time" in ab_bench.report(results, settings, {"A": "a", "B": "b"}, 96, 1, 1)
