"""bench.peer_bench without llama.cpp: its report's arithmetic, llama-server's flags per configuration, and the
draft GGUF it writes (the target's first layers, the same blocks as this server's layer-skip draft)."""

import pytest
import torch

from bench import peer_bench
from bench.peer_bench import LLAMA, OURS, Answer, Config
from specdec.engine import gguf_checkpoint
from tests.unit.test_gguf_checkpoint import LAYERS, write_tiny_llama


def answer(text, tokens, seconds, drafted=None, accepted=None, rounds=None):
    return Answer(text, 30, tokens, seconds, 0.1, drafted, accepted, rounds)


def cells(text, engine, label):
    row = next(line for line in text.splitlines() if line.startswith(f"| {engine}") and f"| {label} " in line)
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_report_divides_by_each_engines_own_target_only_and_by_llama_cpps():
    ours_base = Config(OURS, "target-only", "target-only")
    ours_ngram = Config(OURS, "ngram", "ngram", {"draft_model": "ngram"})
    llama_base = Config(LLAMA, "llama-target-only", "target-only")
    llama_ngram = Config(LLAMA, "llama-ngram", "ngram-simple", server_args=("--x",))
    configs = [ours_base, ours_ngram, llama_base, llama_ngram]
    answers = {("open", ours_base): [(0, answer("a", 100, 2.0, 0, 0, 100)), (1, answer("b", 100, 2.0, 0, 0, 100))],
               ("open", ours_ngram): [(0, answer("a", 100, 1.0, 80, 60, 40)), (1, answer("c", 100, 1.0, 80, 60, 40))],
               ("open", llama_base): [(0, answer("a", 100, 1.0)), (1, answer("d", 100, 1.0))],
               ("open", llama_ngram): [(0, answer("a", 100, 0.8, 40, 10)), (1, answer("d", 100, 0.8, 40, 10))]}
    text = peer_bench.report(answers, configs, "header")
    assert text.startswith("header") and "**open prompts**" in text
    # ours: 50 tok/s target-only, 100 with ngram (2x its own, 1x llama.cpp's 100), 200 tokens in 80 rounds
    assert cells(text, OURS, "ngram")[2:] == ["100.0", "2.00x", "1.00x", "100", "0.75 of 160", "2.50", "1/2", "1/2",
                                              "30.0"]
    assert cells(text, OURS, "target-only")[2:5] == ["50.0", "-", "0.50x"]
    # llama.cpp reports drafted and accepted tokens, no rounds
    assert cells(text, LLAMA, "ngram-simple")[2:] == ["125.0", "1.25x", "1.25x", "100", "0.25 of 80", "-", "2/2",
                                                      "1/2", "30.0"]
    assert cells(text, LLAMA, "target-only")[6:8] == ["-", "-"]
    assert cells(text, OURS, "target-only")[6:8] == ["-", "-"]


def test_llama_servers_flags_name_each_draft_and_leave_out_those_not_given():
    rows = peer_bench.llama_configs(None, None, 3, 4)
    assert [row.label for row in rows] == ["target-only", "ngram-simple (n 3, m 4)"]
    assert rows[0].server_args == ()
    assert rows[1].server_args == ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                   "--spec-ngram-simple-size-m", "4")
    rows = peer_bench.llama_configs("/d/draft.gguf", "/d/eagle3.gguf", 2, 5)
    assert rows[2].server_args == ("--spec-type", "draft-simple", "--spec-draft-model", "/d/draft.gguf",
                                   "--spec-draft-n-max", "5")
    assert rows[3].server_args[:4] == ("--spec-type", "draft-eagle3", "--spec-draft-model", "/d/eagle3.gguf")
    assert all(row.engine == LLAMA for row in rows)
    assert {c.extra_body.get("draft_model") for c in peer_bench.our_configs()} >= {"ngram", "draft_model"}


def test_the_draft_gguf_is_the_targets_first_layers_block_for_block(tmp_path):
    full, cut = tmp_path / "full.gguf", tmp_path / "first1.gguf"
    write_tiny_llama(full)
    peer_bench.write_draft_gguf(full, cut, 1)
    config, weights = gguf_checkpoint.read(full)
    cut_config, cut_weights = gguf_checkpoint.read(cut)
    assert config["num_hidden_layers"] == LAYERS and cut_config["num_hidden_layers"] == 1
    assert not any(name.startswith("model.layers.1.") for name in cut_weights)
    for name, value in cut_weights.items():
        assert torch.equal(value, weights[name]), name
    assert set(cut_weights) == {name for name in weights if not name.startswith("model.layers.1.")}
    assert {k: v for k, v in cut_config.items() if k != "num_hidden_layers"} == {
        k: v for k, v in config.items() if k != "num_hidden_layers"}


def test_the_command_needs_a_llama_server_binary(tmp_path, capsys):
    with pytest.raises(SystemExit):
        peer_bench.main(["--llama-server", str(tmp_path / "missing")])
    assert "llama-server" in capsys.readouterr().err
