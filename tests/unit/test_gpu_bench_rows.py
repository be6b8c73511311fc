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


def test_the_synthetic_pairs_heads_are_built_in_the_published_format_and_the_eagle1_one_is_its_embedding_exit(
        tmp_path, monkeypatch):
    """gpu_bench.synthetic_heads (the GPU session's heads, built instead of trained): the EAGLE-1 head drafts
    what the target's final norm and head make of the next token's embedding, whatever the feature; the
    EAGLE-3 head has the published Llama-3.1-8B head's 32000-token draft vocabulary; both load for the pair."""
    import torch

    from bench.gpu_bench import synthetic_heads, synthetic_pair
    from specdec.engine.draft_heads import HeadCache, load_head_for
    from specdec.serving import pairs

    monkeypatch.setattr(pairs, "cache_dir", lambda: tmp_path)
    target, _ = synthetic_pair(True, "float32", "cpu")
    heads = synthetic_heads(target)
    eagle1, config = load_head_for(heads["eagle1"], target)
    eagle3, _ = load_head_for(heads["eagle3"], target)
    assert eagle3.lm_head.out_features == 32000
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tokens = torch.tensor([3, 500, 4000, 12345, 40000])
    with torch.no_grad():
        exit_logits = model.lm_head(model.model.norm(model.model.embed_tokens(tokens)))
        for row, token in enumerate(tokens):
            feature = torch.randn(1, config.hidden_size)  # dropped by the head's fc
            _, logits = eagle1.step(token.reshape(1), feature, torch.tensor([row]), HeadCache().window(0))
            assert int(logits.argmax()) == int(exit_logits[row].argmax())
            # The exit's logits up to each token's RMS against the mean one the fc divides by (~1 % apart at
            # 4096 wide, more at the tiny pair's 64): the target's scale, so its confidence means the same
            assert torch.nn.functional.cosine_similarity(logits[0], exit_logits[row], dim=0) > 0.9999
            assert 0.75 < float(logits[0].norm() / exit_logits[row].norm()) < 1.33
    assert synthetic_heads(target) == heads  # built once
