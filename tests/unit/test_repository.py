import re

from specdec import tensor_names as tn
from specdec.serving.pairs import PairSpec
from specdec.serving.repository import SOURCE, render, set_parameter


def test_set_parameter_replaces_and_adds():
    cfg = 'parameters { key: "model_path", value: { string_value: "/models/x" } }\n'
    out = set_parameter(cfg, "model_path", "/data/y")
    assert '"/data/y"' in out and "/models/x" not in out
    out = set_parameter(out, "dtype", "float16")
    assert 'key: "dtype", value: { string_value: "float16" }' in out


def test_render_points_every_model_at_the_pair(tmp_path):
    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok",
                    draft_paths={"draft_model": "/w/draft", "draft_model_b": "/w/draft_b"},
                    dtype="float64", max_context_tokens=512, apply_chat_template=True, device="gpu",
                    target_gpu=1, draft_gpu=0, default_num_draft_tokens=6)
    repo = render(pair, tmp_path / "repo")
    cfg = {d.name: (d / "config.pbtxt").read_text() for d in repo.iterdir()}
    assert '"/w/target"' in cfg["target_model"] and '"float64"' in cfg["target_model"]
    assert '"/w/draft"' in cfg["draft_model"]
    assert 'name: "draft_model_b"' in cfg["draft_model_b"] and '"/w/draft_b"' in cfg["draft_model_b"]
    assert '"draft_model,draft_model_b,ngram,suffix,ngram+draft_model,ngram+draft_model_b"' in cfg["speculative_decoding"]
    assert '"512"' in cfg["speculative_decoding"]
    assert 'key: "apply_chat_template", value: { string_value: "true" }' in cfg["preprocessing"]
    assert "kind: KIND_GPU, gpus: [ 1 ]" in cfg["target_model"] and "kind: KIND_GPU, gpus: [ 0 ]" in cfg["draft_model"]
    assert 'key: "device", value: { string_value: "cuda" }' in cfg["draft_model"]
    assert 'key: "default_num_draft_tokens", value: { string_value: "6" }' in cfg["speculative_decoding"]
    assert "KIND_CPU" in cfg["speculative_decoding"]  # tokenizers and the orchestrator stay on the CPU


def test_render_spread_target_and_ngram_only(tmp_path):
    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", default_draft="ngram",
                    device="gpu", spread_target=True)
    repo = render(pair, tmp_path / "repo")
    assert not (repo / "draft_model").exists()
    target = (repo / "target_model" / "config.pbtxt").read_text()
    assert "kind: KIND_MODEL" in target and 'key: "device_map", value: { string_value: "auto" }' in target
    assert '"draft_models", value: { string_value: "ngram,suffix" }' in (repo / "speculative_decoding" / "config.pbtxt").read_text()


def test_ensemble_exposes_the_public_contract():
    """Every public tensor name in tensor_names appears in the committed ensemble config."""
    cfg = (SOURCE / "ensemble" / "config.pbtxt").read_text()
    declared = set(re.findall(r'\{ name: "(\w+)"', cfg))
    public = {tn.TEXT_INPUT, tn.MAX_TOKENS, tn.NUM_DRAFT_TOKENS, tn.TEMPERATURE, tn.TOP_K, tn.TOP_P, tn.SEED,
              tn.STREAM, tn.END_ID, tn.DRAFT_MODEL, tn.TEXT_OUTPUT, tn.FINISH_REASON, tn.NUM_INPUT_TOKENS,
              tn.NUM_OUTPUT_TOKENS, tn.TOTAL_DRAFT_TOKENS, tn.TOTAL_ACCEPTED_DRAFT_TOKENS, tn.ACCEPTANCE_RATE}
    assert public <= declared


def test_override_sets_one_models_parameter(tmp_path):
    import pytest

    from specdec.serving.repository import override

    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", draft_paths={"draft_model": "/w/d"})
    repo = render(pair, tmp_path / "repo")
    override(repo, "target_model.batched_forward=false")
    assert 'key: "batched_forward", value: { string_value: "false" }' in (repo / "target_model" / "config.pbtxt").read_text()
    assert 'key: "batched_forward", value: { string_value: "true" }' in (repo / "draft_model" / "config.pbtxt").read_text()
    for bad in ("target_model=1", "nosuchmodel.x=1", "target_model.x"):
        with pytest.raises(ValueError, match="MODEL.PARAMETER=VALUE"):
            override(repo, bad)



def test_override_sets_the_sequence_batchers_delay(tmp_path):
    import pytest

    from specdec.serving.repository import override

    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", draft_paths={"draft_model": "/w/d"})
    repo = render(pair, tmp_path / "repo")
    override(repo, "target_model.max_queue_delay_microseconds=300")
    config = (repo / "target_model" / "config.pbtxt").read_text()
    assert "max_queue_delay_microseconds: 300 " in config and "max_queue_delay_microseconds" not in config.split("parameters")[-1]
    assert "max_queue_delay_microseconds: 0 " in (repo / "draft_model" / "config.pbtxt").read_text()
    for bad in ("target_model.max_queue_delay_microseconds=-1", "preprocessing.max_queue_delay_microseconds=5"):
        with pytest.raises(ValueError, match="sequence batcher delay"):
            override(repo, bad)


def test_render_and_launcher_flag_for_skip_drafts(tmp_path):
    import dataclasses

    import pytest

    from specdec.serving.launcher import with_skip_drafts

    base = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", default_draft="ngram")
    pair = with_skip_drafts(base, ["auto", "fixed=3,5-7"])
    assert pair.skip_drafts == {tn.DEFAULT_SKIP_DRAFT_NAME: "auto", "fixed": "3,5-7"}
    for wrong, message in (("ngram=auto", "taken"), ("x=every", "neither 'auto' nor a list")):
        with pytest.raises(ValueError, match=message):
            with_skip_drafts(base, [wrong])
    repo = render(dataclasses.replace(pair), tmp_path / "repo")
    skip = (repo / tn.DEFAULT_SKIP_DRAFT_NAME / "config.pbtxt").read_text()
    assert f'name: "{tn.DEFAULT_SKIP_DRAFT_NAME}"' in skip and '"/w/target"' in skip
    assert 'key: "draft_kind", value: { string_value: "skip" }' in skip
    assert 'key: "skip_layers", value: { string_value: "3,5-7" }' in (repo / "fixed" / "config.pbtxt").read_text()
    assert f'"ngram,{tn.DEFAULT_SKIP_DRAFT_NAME},fixed,suffix,ngram+{tn.DEFAULT_SKIP_DRAFT_NAME},ngram+fixed"' in (repo / "speculative_decoding" / "config.pbtxt").read_text()
    assert not (repo / "draft_model").exists()


def test_render_sets_a_pairs_parameters_of_single_models(tmp_path):
    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target",
                    draft_paths={"draft_model": "/w/d", "draft_model_b": "/w/b"},
                    model_parameters={"draft_model_b": {"draft_stop_below": "0"}})
    repo = render(pair, tmp_path / "repo")
    assert 'key: "draft_stop_below", value: { string_value: "0" }' in (repo / "draft_model_b" / "config.pbtxt").read_text()
    assert 'key: "draft_stop_below", value: { string_value: "0.3" }' in (repo / "draft_model" / "config.pbtxt").read_text()


def test_render_rounds_the_heads_weights_on_a_cpu_in_float32_only(tmp_path):
    """cpu_head_weights_dtype (the default pair's q8): the heads' weights_dtype on a CPU in float32; elsewhere,
    and for the models, the pair's weights_dtype."""
    import dataclasses

    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", draft_paths={"draft_model": "/w/d"},
                    draft_heads={"eagle3": "/w/head"}, cpu_head_weights_dtype="q8")
    for spec, head, models in ((pair, "q8", "same"), (dataclasses.replace(pair, device="gpu"), "same", "same"),
                               (dataclasses.replace(pair, dtype="bfloat16"), "same", "same"),
                               (dataclasses.replace(pair, device="gpu", weights_dtype="fp8"), "fp8", "fp8"),
                               (dataclasses.replace(pair, cpu_head_weights_dtype="same", weights_dtype="q8"), "q8", "q8")):
        repo = render(spec, tmp_path / f"repo-{spec.device}-{spec.dtype}-{spec.weights_dtype}-{spec.cpu_head_weights_dtype}")
        for name, want in (("eagle3", head), ("target_model", models), ("draft_model", models)):
            assert f'key: "weights_dtype", value: {{ string_value: "{want}" }}' in (repo / name / "config.pbtxt").read_text()


def test_render_sets_the_pairs_executor_on_every_language_model(tmp_path, capsys):
    import pytest

    from specdec.serving import launcher, pairs

    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", draft_paths={"draft_model": "/w/d"},
                    skip_drafts={"skip": "1"}, executor="dynamic")
    repo = render(pair, tmp_path / "repo")
    for model in ("target_model", "draft_model", "skip"):
        assert 'key: "executor", value: { string_value: "dynamic" }' in (repo / model / "config.pbtxt").read_text()
    committed = (SOURCE / "target_model" / "config.pbtxt").read_text()
    assert 'key: "executor", value: { string_value: "auto" }' in committed
    # the tests' tiny pair serves on the static executor, as GPUs and float32 CPUs do
    assert pairs.tiny_pair().executor == "static" and PairSpec(name="t", target_path="", tokenizer_path="").executor == "auto"
    assert launcher.parse_args(["--executor", "dynamic"]).executor == "dynamic"
    assert launcher.parse_args([]).executor is None  # the pair's own
    with pytest.raises(SystemExit):
        launcher.parse_args(["--executor", "static", "--model-repository", str(tmp_path)])
    assert "--executor is set in a rendered repository" in capsys.readouterr().err


def test_render_and_launcher_flag_for_lora_adapters(tmp_path):
    """--lora-modules NAME=DIR: the target runs them and the orchestrator admits their names (one rendered
    value), which the launcher reads back for the OpenAI API; a directory without an adapter is refused."""
    import pytest

    from specdec.serving.launcher import with_lora_adapters
    from specdec.serving.repository import served_adapters

    for name in ("sql", "chat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    base = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/target", default_draft="ngram")
    pair = with_lora_adapters(base, [f"sql={tmp_path / 'sql'}", f"chat-v2={tmp_path / 'chat'}"])
    assert pair.lora_adapters == {"sql": str(tmp_path / "sql"), "chat-v2": str(tmp_path / "chat")}
    for wrong, message in ((f"sql={tmp_path / 'sql'}", "given twice"), (f"x={tmp_path}", "no adapter_config.json"),
                           ("x y=/z", "NAME=DIR"), ("/z", "NAME=DIR")):
        with pytest.raises(ValueError, match=message):
            with_lora_adapters(pair, [wrong])
    repo = render(pair, tmp_path / "repo")
    value = f"sql={tmp_path / 'sql'},chat-v2={tmp_path / 'chat'}"
    for model in ("target_model", "speculative_decoding"):
        assert f'key: "lora_adapters", value: {{ string_value: "{value}" }}' in (repo / model / "config.pbtxt").read_text()
    assert served_adapters(repo) == (["sql", "chat-v2"], "")
    assert served_adapters(render(base, tmp_path / "plain")) == ([], "")
    # --lora-directory, --max-loras, --max-lora-rank: the target's parameters, the orchestrator's directory
    library = tmp_path / "library"
    library.mkdir()
    pair = with_lora_adapters(base, [f"sql={tmp_path / 'sql'}"], str(library), 3, 8)
    repo = render(pair, tmp_path / "with-library")
    target = (repo / "target_model" / "config.pbtxt").read_text()
    for key, value in (("lora_directory", str(library)), ("max_loras", "3"), ("max_lora_rank", "8")):
        assert f'key: "{key}", value: {{ string_value: "{value}" }}' in target, key
    assert served_adapters(repo) == (["sql"], str(library))
    for args, message in (([[], str(tmp_path / "none")], "--lora-directory .*none: not a directory"),
                          ([[f"sql={tmp_path / 'sql'}"], str(library), 1], "--max-loras 1 holds no adapter of "
                                                                             "--lora-directory beside the 1"),
                          ([[], "", -1], "counts")):
        with pytest.raises(ValueError, match=message):
            with_lora_adapters(base, *args)
