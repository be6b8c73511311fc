"""Training draft heads of every kind (specdec.train: eagle, medusa, trainer, the command): what training computes
is what serving runs (EAGLE's training-time test against the head's own drafting, Medusa's trained rows
against the written heads), and the command trains each kind, lowering its held-out loss, into a layout
the loader reads back."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from specdec.engine.draft_heads import EAGLE, EAGLE3, MEDUSA, TRAINED, HeadCache, load_head, random_head, target_tensors
from specdec.serving import pairs
from specdec.train.__main__ import main as train_command
from specdec.train.data import answer_and_featurize
from specdec.train.eagle import EagleObjective, grown, unrolled
from specdec.train.medusa import MedusaObjective, start_from_target
from specdec.train.trainer import collate
from tests.unit.test_train_data import CharTokenizer

AUX = (0, 1, 1)


@pytest.fixture(scope="module")
def sample(tiny_lm):
    """One prompt + answer of the tiny float64 target, its features kept in float64."""
    import dataclasses

    (one,) = answer_and_featurize(tiny_lm, CharTokenizer(), ["what the head reads"], AUX, 16, chat_template=False,
                                  log=lambda message: None)
    with torch.no_grad():
        states = tiny_lm(one.tokens[None], output_hidden_states=True).hidden_states
    return dataclasses.replace(one, features=torch.cat([states[layer + 1][0] for layer in AUX], dim=-1),
                               final=states[-1][0])


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3, "eagle3-normed", "eagle3-qwen3"])
def test_the_training_time_test_computes_what_drafting_serves(tiny_lm, sample, kind):
    normed = kind == "eagle3-normed"  # the speculators library's variant: residual normed, a norm before fc
    qwen3 = kind == "eagle3-qwen3"  # its heads for Qwen3 targets: Qwen3 layers (with biases, and three, here)
    kind = EAGLE3 if normed or qwen3 else kind
    head = random_head(kind, tiny_lm.config, seed=2, aux_layers=AUX if kind == EAGLE3 else (),
                       norm_before_residual=normed, norm_before_fc=normed, layer_type="qwen3" if qwen3 else "llama",
                       attention_bias=qwen3, num_layers=3 if qwen3 else 1).to(torch.float64)
    if qwen3:
        with torch.no_grad():  # per-head norms and plain layers' input norms that are not the identity
            generator = torch.Generator().manual_seed(3)
            for layer in head.decoder_layers():
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm):
                    norm.weight.copy_(1 + torch.rand(norm.weight.shape, generator=generator))
    head.attach(*target_tensors(tiny_lm))
    tokens = sample.tokens
    entries = len(tokens) - 1
    features = sample.features if kind == EAGLE3 else sample.final
    with torch.no_grad():
        one = collate([sample], "cpu", torch.float64)
        steps = [step[0] for step in unrolled(head, one, 3, "cpu")]
        # Step 0: the head's entries filled from the target's features, as a round's call fills them
        filled, logits = head(tokens[1:entries + 1], head.from_target(features[:entries]), HeadCache(), 0)
        torch.testing.assert_close(steps[0], filled, rtol=1e-10, atol=1e-10)
        # Its agreement at the first position is the served head's argmax against the target's, on the answer
        objective = EagleObjective(head, 3, target_tensors(tiny_lm)[1], torch.arange(tiny_lm.config.vocab_size), "cpu")
        _, hits = objective.loss_and_hits(one, evaluating=True)
        on_answer = torch.arange(1, entries + 1) >= sample.prompt_length - 1
        agree = logits.argmax(-1) == sample.greedy[1:]
        assert hits[0] == (int((agree & on_answer).sum()), int(on_answer.sum()))
        # Step j of the chain started at entry i: drafting j tokens on from there, on the head's own output
        for i in (0, 3, entries - 4):
            cache = HeadCache()
            out, _ = head(tokens[1:i + 2], head.from_target(features[:i + 1]), cache, 0)
            out = out[-1:]
            for j in (1, 2):
                out, _ = head(tokens[i + j + 1:i + j + 2], out, cache, i + j)
                torch.testing.assert_close(steps[j][i], out[0], rtol=1e-10, atol=1e-10)


def test_a_head_grown_by_plain_layers_drafts_as_before_until_they_train(tiny_lm, sample):
    """`grown`: layers added after a trained head's start as the identity (the speculators library's several-
    layer heads, started from a one-layer head); a step of training moves them."""
    head = random_head(EAGLE3, tiny_lm.config, seed=4, aux_layers=AUX, norm_before_residual=True).to(torch.float64)
    head.attach(*target_tensors(tiny_lm))
    bigger = grown(head, 3)
    assert len(bigger.decoder_layers()) == 3 and bigger.config.num_layers == 3
    assert bigger.embed.data_ptr() == head.embed.data_ptr()  # the same borrowed embedding
    tokens, features = sample.tokens[1:9], head.from_target(sample.features[:8])
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(head(tokens, features, HeadCache(), 0),
                                                      bigger(tokens, features, HeadCache(), 0)))
    objective = EagleObjective(bigger, 2, target_tensors(tiny_lm)[1], torch.arange(tiny_lm.config.vocab_size), "cpu")
    loss, _ = objective.loss_and_hits(collate([sample], "cpu", torch.float64), evaluating=False)
    loss.backward()
    added = bigger.layers["2"]
    assert added.self_attn.o_proj.weight.grad.abs().sum() > 0 and added.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="an EAGLE-3 head grows plain layers"):
        grown(bigger, 2)


def test_medusa_heads_start_as_the_target_and_serve_the_rows_they_trained(tiny_lm, sample):
    embed, lm_head = target_tensors(tiny_lm)
    heads = random_head(MEDUSA, tiny_lm.config, seed=2, medusa_heads=3).to(torch.float64)
    start_from_target(heads, lm_head.detach())
    final = sample.final
    with torch.no_grad():
        for j in range(3):  # untrained, every head proposes the target's own next token
            torch.testing.assert_close(heads(final[4], 3)[j], lm_head @ final[4])
        draft_ids = torch.tensor([1, 5, 9, 40, 77])
        objective = MedusaObjective(heads, lm_head.detach(), draft_ids, "cpu")
        for parameter in objective.module.parameters():  # as if trained
            parameter.add_(torch.randn_like(parameter) * 0.3)
        blocks = [block(final) for block in objective.module.blocks]
        trained = [x @ objective.module.rows[j].T for j, x in enumerate(blocks)]
        objective.module.finish()
        for j in range(3):
            served = torch.stack([heads(f, 3)[j] for f in final])
            torch.testing.assert_close(served[:, draft_ids], trained[j])
            others = torch.ones(len(lm_head), dtype=torch.bool)
            others[draft_ids] = False
            torch.testing.assert_close(served[:, others], blocks[j] @ lm_head[others].T)  # the target's rows


@pytest.mark.parametrize("kind", TRAINED)
def test_a_padded_batch_computes_what_each_sample_computes_alone(tiny_lm, kind):
    """Samples of different lengths in one batch: each one's unrolled rows, and every step's hits and
    positions, are what it gets alone (the padding on the right changes nothing real)."""
    from specdec.train.trainer import evaluate

    samples = answer_and_featurize(tiny_lm, CharTokenizer(), ["a short one", "a much longer prompt than the others", "x"],
                                   AUX, 12, chat_template=False, log=lambda message: None, store_dtype=torch.float64)
    assert len({len(s.tokens) for s in samples}) == 3
    embed, lm_head = target_tensors(tiny_lm)
    if kind == MEDUSA:
        heads = random_head(MEDUSA, tiny_lm.config, seed=2, medusa_heads=3).to(torch.float64)
        start_from_target(heads, lm_head.detach())
        objective = MedusaObjective(heads, lm_head.detach(), torch.arange(0, 97, 2), "cpu")
        with torch.no_grad():
            objective.module.rows.add_(torch.randn_like(objective.module.rows))
    else:
        head = random_head(kind, tiny_lm.config, seed=2, aux_layers=AUX if kind == EAGLE3 else ()).to(torch.float64)
        head.attach(embed, lm_head if kind == EAGLE else None)
        ids = head.draft_target_ids() if kind == EAGLE3 else torch.arange(0, 97, 2)
        objective = EagleObjective(head, 3, lm_head.detach(), ids, "cpu")
    batch = collate(samples, "cpu", torch.float64)
    with torch.no_grad():
        if kind != MEDUSA:
            together = unrolled(objective.module, batch, 3, "cpu")
            for b, sample in enumerate(samples):
                alone = unrolled(objective.module, collate([sample], "cpu", torch.float64), 3, "cpu")
                for j, rows in enumerate(alone):
                    torch.testing.assert_close(together[j][b, :rows.shape[1]], rows[0], rtol=1e-10, atol=1e-10)
        _, hits = objective.loss_and_hits(batch, evaluating=True)
        separate = [objective.loss_and_hits(collate([s], "cpu", torch.float64), evaluating=True)[1] for s in samples]
    assert hits == [tuple(map(sum, zip(*(per[j] for per in separate)))) for j in range(len(hits))]
    assert all(count > hit for hit, count in hits)  # positions counted, not all hits: the check can fail
    assert evaluate(objective, samples)["alpha"] == [hit / count for hit, count in hits]


@pytest.mark.parametrize("kind", TRAINED)
def test_the_command_trains_each_kind_and_writes_what_the_loader_reads(tmp_path, kind):
    target = pairs.tiny_pair().target_path
    out = tmp_path / kind
    code = train_command(["--target", target, "--out", str(out), "--kind", kind, "--max-prompts", "16",
                          "--answer-tokens", "24", "--epochs", "4", "--lr", "3e-3", "--draft-vocab", "1024",
                          "--aux-layers", "0,1,1", "--steps", "2", "--medusa-heads", "2", "--no-chat-template",
                          "--device", "cpu"])
    assert code == 0
    record = json.loads((out / "training.json").read_text())
    assert record["kind"] == kind and record["held_out_loss"] < record["held_out_loss_before"], record
    assert len(record["held_out_alpha"]) == 2
    head = load_head(out)
    assert head.config.kind == kind
    if kind == MEDUSA:
        assert head.config.medusa_heads == 2 and (out / "medusa_lm_head.safetensors").exists()
    # The answered samples train another kind as they are (--data)
    if kind == EAGLE:
        again = train_command(["--target", target, "--out", str(tmp_path / "again"), "--kind", MEDUSA,
                               "--data", str(out / "data.pt"), "--epochs", "1", "--draft-vocab", "1024",
                               "--medusa-heads", "2", "--device", "cpu"])
        assert again == 0 and not (tmp_path / "again" / "data.pt").exists()
    if kind == EAGLE3:  # the speculators library's layout, which vLLM serves as it is
        again = train_command(["--target", target, "--out", str(tmp_path / "spec"), "--kind", EAGLE3, "--data",
                               str(out / "data.pt"), "--epochs", "1", "--draft-vocab", "1024", "--aux-layers", "0,1,1",
                               "--steps", "2", "--layout", "speculators", "--head-layers", "2", "--device", "cpu"])
        config = json.loads((tmp_path / "spec" / "config.json").read_text())
        assert again == 0 and config["speculators_model_type"] == EAGLE3
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(Path(target).resolve())
        assert config["transformer_layer_config"]["num_hidden_layers"] == 2  # a head of two layers (--head-layers)
        record = json.loads((tmp_path / "spec" / "training.json").read_text())
        assert record["held_out_loss"] < record["held_out_loss_before"], record
        spec = load_head(tmp_path / "spec")
        assert spec.config.aux_layers == (0, 1, 1) and len(spec.decoder_layers()) == 2
        # a trained head grown by a layer (it starts as the identity) and trained on
        grown_code = train_command(["--target", target, "--out", str(tmp_path / "grown"), "--kind", EAGLE3, "--data",
                                    str(out / "data.pt"), "--epochs", "1", "--aux-layers", "0,1,1", "--steps", "2",
                                    "--init", str(tmp_path / "spec"), "--head-layers", "3", "--device", "cpu"])
        record = json.loads((tmp_path / "grown" / "training.json").read_text())
        assert grown_code == 0 and record["head_layers"] == 3
        assert len(load_head(tmp_path / "grown").decoder_layers()) == 3
        with pytest.raises(SystemExit, match="--head-layers 1: the head in --init .* has 3; layers are added"):
            train_command(["--target", target, "--out", str(tmp_path / "fewer"), "--kind", EAGLE3, "--data",
                           str(out / "data.pt"), "--aux-layers", "0,1,1", "--init", str(tmp_path / "grown"),
                           "--head-layers", "1", "--device", "cpu"])
    if kind == MEDUSA:
        with pytest.raises(SystemExit, match="--layout speculators holds EAGLE heads"):
            train_command(["--target", target, "--out", str(tmp_path / "m"), "--kind", MEDUSA, "--layout",
                           "speculators"])
        with pytest.raises(SystemExit, match="--head-layers 2: EAGLE-3 heads have one or more decoder layers"):
            train_command(["--target", target, "--out", str(tmp_path / "m"), "--kind", MEDUSA, "--head-layers", "2"])


def test_the_command_adds_grounded_prompts_over_its_own_answers_and_trains_under_autocast(tmp_path):
    """--grounded: instructions over the target's own answers, answered too (held out in the same share);
    --answer-dtype bfloat16 writes the answers in bfloat16 while the features stay the float32 target's;
    --autocast bfloat16 still lowers the held-out loss and writes a float32 head."""
    from transformers import AutoTokenizer

    from specdec.train.data import GROUNDED_INSTRUCTIONS

    target = pairs.tiny_pair().target_path
    out = tmp_path / "grounded"
    code = train_command(["--target", target, "--out", str(out), "--max-prompts", "20", "--answer-tokens", "48",
                          "--grounded", "6", "--answer-dtype", "bfloat16", "--autocast", "bfloat16", "--epochs", "3",
                          "--lr", "3e-3", "--draft-vocab", "1024", "--aux-layers", "0,1,1", "--steps", "2",
                          "--no-chat-template", "--device", "cpu"])
    assert code == 0
    record = json.loads((out / "training.json").read_text())
    assert record["held_out_loss"] < record["held_out_loss_before"], record
    saved = torch.load(out / "data.pt", weights_only=False)
    assert (len(saved["train"]), len(saved["held_out"])) == (18 + 5, 2 + 1)  # 6 grounded: 1 held out (2 of 20)
    tokenizer = AutoTokenizer.from_pretrained(target)
    for sample in saved["train"][-5:] + saved["held_out"][-1:]:
        prompt = tokenizer.decode(sample.tokens[:sample.prompt_length], skip_special_tokens=True)
        assert any(instruction in prompt for instruction in GROUNDED_INSTRUCTIONS), prompt[:80]
        assert sample.features.dtype == torch.float32 and sample.final.dtype == torch.float32
    assert load_head(out).fc.weight.dtype == torch.float32


def test_sets_of_sampled_answers_add_to_a_greedy_one_and_train_together_in_batches_and_further(tmp_path):
    """--sampled-answers N --no-greedy-answers answers the training prompts by sampling only (features kept in
    bfloat16 with --store-dtype); --data given twice trains on both sets (the held-out conversations both hold
    counted once), --batch samples per step; a checkpoint resumes only with the batch it was written with;
    --init trains a written head further."""
    target = pairs.tiny_pair().target_path
    common = ["--target", target, "--max-prompts", "10", "--answer-tokens", "16", "--draft-vocab", "1024",
              "--aux-layers", "0,1,1", "--steps", "2", "--no-chat-template", "--device", "cpu"]
    assert train_command(common + ["--out", str(tmp_path / "greedy"), "--epochs", "0"]) == 0
    assert train_command(common + ["--out", str(tmp_path / "sampled"), "--epochs", "0", "--sampled-answers", "1",
                                   "--no-greedy-answers", "--store-dtype", "bfloat16"]) == 0
    greedy = torch.load(tmp_path / "greedy" / "data.pt", weights_only=False)
    sampled = torch.load(tmp_path / "sampled" / "data.pt", weights_only=False)
    assert len(greedy["train"]) == len(sampled["train"]) == 9
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(greedy["train"], sampled["train"]))
    assert all(s.features.dtype == s.final.dtype == torch.bfloat16 for s in sampled["train"])
    assert [s.tokens.tolist() for s in sampled["held_out"]] == [s.tokens.tolist() for s in greedy["held_out"]]
    both = common + ["--out", str(tmp_path / "both"), "--data", str(tmp_path / "greedy" / "data.pt"),
                     "--data", str(tmp_path / "sampled" / "data.pt"), "--epochs", "3", "--lr", "3e-3"]
    assert train_command(both + ["--batch", "4"]) == 0
    record = json.loads((tmp_path / "both" / "training.json").read_text())
    assert (record["samples"], record["held_out"], record["batch"]) == (18, 1, 4)
    assert record["held_out_loss"] < record["held_out_loss_before"], record
    with pytest.raises(SystemExit, match="--batch 4"):
        train_command(both + ["--batch", "2"])
    # --init: a trained head goes on training where it stopped (its held-out figures are where they were)
    more = common + ["--data", str(tmp_path / "sampled" / "data.pt"), "--epochs", "1", "--init", str(tmp_path / "both")]
    assert train_command(more + ["--out", str(tmp_path / "more")]) == 0
    again = json.loads((tmp_path / "more" / "training.json").read_text())
    # (to bfloat16's rounding: "both" evaluated the held-out conversation's float32 features, the greedy set's,
    # "more" the sampled set's bfloat16 ones; a head started anew would be ~2x off)
    assert again["held_out_loss_before"] == pytest.approx(record["held_out_loss"], rel=1e-3)
    assert again["init"] == str((tmp_path / "both").resolve())
    with pytest.raises(SystemExit, match="--init"):
        train_command(more + ["--out", str(tmp_path / "other"), "--kind", "medusa"])
    # Every answering run keeps its conversations without features (answers.jsonl.gz): --answers trains on
    # them as --data trains on the run's data.pt (the features computed again, the same)
    by_data = common + ["--data", str(tmp_path / "greedy" / "data.pt"), "--epochs", "1"]
    by_answers = common + ["--answers", str(tmp_path / "greedy" / "answers.jsonl.gz"), "--epochs", "1"]
    assert train_command(by_data + ["--out", str(tmp_path / "by-data")]) == 0
    assert train_command(by_answers + ["--out", str(tmp_path / "by-answers")]) == 0
    figures = [json.loads((tmp_path / name / "training.json").read_text()) for name in ("by-data", "by-answers")]
    for key in ("samples", "held_out", "tokens", "held_out_loss_before", "held_out_loss", "held_out_alpha"):
        assert figures[0][key] == figures[1][key], key
    # the run keeps the features it computed; started again (as after an interruption) it reads them
    (kept,) = (tmp_path / "by-answers").glob("features-answers-*.pt")
    (tmp_path / "by-answers" / "training.json").unlink()
    import specdec.train.data as train_data
    featurize, train_data.featurize = train_data.featurize, None  # a call would fail
    try:
        assert train_command(by_answers + ["--out", str(tmp_path / "by-answers")]) == 0
    finally:
        train_data.featurize = featurize
    again = json.loads((tmp_path / "by-answers" / "training.json").read_text())
    assert (again["samples"], again["held_out"]) == (figures[1]["samples"], figures[1]["held_out"])
    assert kept.exists() and not list((tmp_path / "by-answers").glob("*.partial"))
    # --answers-only: the same conversations, no features, nothing trained
    assert train_command(common + ["--out", str(tmp_path / "only"), "--answers-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == ["answers.jsonl.gz"]
    with gzip.open(tmp_path / "only" / "answers.jsonl.gz", "rt") as a, \
            gzip.open(tmp_path / "greedy" / "answers.jsonl.gz", "rt") as b:
        assert a.read() == b.read()
    with pytest.raises(SystemExit, match="--answers-only"):
        train_command(common + ["--out", str(tmp_path / "only2"), "--answers-only", "--data",
                                str(tmp_path / "greedy" / "data.pt")])


def test_the_head_acceptance_bench_unrolls_each_head_over_the_same_answers(tmp_path):
    """`bench/head_alpha.py` on the tiny target: a row per head and prompt set, α per drafted position, and
    the accepted tokens per round a chain of them gets (α_1 + α_1·α_2 + ...)."""
    from bench import head_alpha
    from specdec.engine.draft_heads import save_head

    assert head_alpha.accepted_per_round([0.5, 0.5, 0.0]) == 0.75
    target = pairs.tiny_pair().target_path
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    for kind in (EAGLE, EAGLE3):
        save_head(random_head(kind, config, seed=1, draft_vocab_size=64, aux_layers=AUX),
                  tmp_path / kind)
    out = tmp_path / "alpha.md"
    assert head_alpha.main(["--target", target, "--head", f"one={tmp_path / EAGLE}", "--head", f"three={tmp_path / EAGLE3}",
                            "--prompts", "1", "--max-tokens", "6", "--steps", "2", "--out", str(out)]) == 0
    lines = [line for line in out.read_text().splitlines() if line.startswith("| open") or line.startswith("| grounded")]
    assert len(lines) == 4 and all(len(line.split("|")[3].split()) == 2 for line in lines)


def test_the_command_answers_its_self_written_requests_with_their_own_held_out_share(tmp_path):
    """--self-prompts N adds the requests the target wrote (OUT/self_prompts.jsonl, drawn once: a run that
    finds the file answers it rather than drawing again) to --prompts, given twice; each set keeps its own
    held-out share."""
    from transformers import AutoTokenizer

    target = pairs.tiny_pair().target_path
    out = tmp_path / "self"
    out.mkdir()
    written = [f"Could you tell me about topic number {i}?" for i in range(10)]
    (out / "self_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in written))
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for n, file in enumerate(files):
        file.write_text("".join(json.dumps({"prompt": f"composed prompt {n}-{i}"}) + "\n" for i in range(5)))
    code = train_command(["--target", target, "--out", str(out), "--prompts", str(files[0]), "--prompts",
                          str(files[1]), "--self-prompts", "10", "--answer-tokens", "8", "--epochs", "0",
                          "--draft-vocab", "1024", "--aux-layers", "0,1,1", "--device", "cpu"])
    assert code == 0
    saved = torch.load(out / "data.pt", weights_only=False)
    tokenizer = AutoTokenizer.from_pretrained(target)
    asked = lambda samples: [tokenizer.decode(s.tokens[:s.prompt_length]) for s in samples]  # noqa: E731
    # 10 composed (1 held out: the last of the two files) and 10 self-written (1 held out)
    assert (len(saved["train"]), len(saved["held_out"])) == (18, 2)
    assert ["composed prompt 1-4" in a for a in asked(saved["held_out"])] == [True, False]
    assert written[-1] in asked(saved["held_out"])[1]
    assert sum(any(w in a for w in written) for a in asked(saved["train"])) == 9


def test_the_command_renders_prompts_with_the_servers_chat_template_and_refuses_one_not_there(tmp_path):
    """--chat-template (the server's): the head trains on prompts as they will be served."""
    from specdec.decoding.text import load_tokenizer

    target = pairs.tiny_pair().target_path
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    common = ["--target", target, "--max-prompts", "4", "--answer-tokens", "4", "--draft-vocab", "1024",
              "--aux-layers", "0,1,1", "--epochs", "0", "--device", "cpu"]
    assert train_command(common + ["--out", str(tmp_path / "own"), "--chat-template", template]) == 0
    data = torch.load(tmp_path / "own" / "data.pt", weights_only=False)
    tokenizer = load_tokenizer(target)
    texts = [tokenizer.decode(s.tokens) for s in data["train"] + data["held_out"]]
    assert len(texts) == 4 and all(text.startswith("Q: ") and "\nA:" in text for text in texts), texts
    with pytest.raises(SystemExit, match="--chat-template: '/no/template.jinja' is neither a file nor a Jinja"):
        train_command(common + ["--out", str(tmp_path / "none"), "--chat-template", "/no/template.jinja"])
