"""bench/gpu_bench.py's batch-1 rows: which settings and drafts each row runs (no server, no GPU)."""

import pytest


def test_gpu_bench_draft_rows_name_their_draft_and_branches_beside_the_plain_rows():
    """gpu_bench --drafts: each NAME[:BRANCHES] adds K fixed and adaptive rows naming that draft (its trees
    above one branch); a malformed spec is refused naming the option."""
    from bench.gpu_bench import one_stream_settings, parse_draft_rows

    drafts = parse_draft_rows(["swift", "eagle3:2"])
    assert drafts == [("swift", 1), ("eagle3", 2)]
    rows = one_stream_settings(4, [], ("K=0", "K", "adaptive"), drafts)
    assert list(rows)[:3] == ["K=0", "K=4", "adaptive K<=4"] and "draft_model" not in rows["K=4"]
    assert rows["swift, K=4"] == dict(num_draft_tokens=4, adaptive_draft=False, draft_model="swift",
                                      num_draft_branches=1)
    assert rows["eagle3, trees of 2 branches, adaptive K<=4"]["adaptive_draft"] is True
    assert set(one_stream_settings(4, [], ("K=0", "K"), drafts)) == {"K=0", "K=4", "swift, K=4",
                                                                     "eagle3, trees of 2 branches, K=4"}
    for bad in ("", "eagle3:x", "eagle3:0", ":2"):
        with pytest.raises(SystemExit, match="--drafts"):
            parse_draft_rows([bad])
