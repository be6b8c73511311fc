"""vLLM's --speculative-config read as the launcher's draft settings (serving/speculative_config.py), and the
launcher applying it (the flags it stands for, refusals before anything starts)."""

import json

import pytest

from specdec import tensor_names as tn
from specdec.serving import launcher, repository
from specdec.serving.pairs import PairSpec
from specdec.serving.speculative_config import Speculation, Speculator, from_sglang, read, speculator

pytestmark = pytest.mark.usefixtures("server_ports_free")  # (tests/unit/conftest.py)


def test_each_method_stands_for_a_draft_of_this_server(tmp_path):
    head = tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}))
    draft = tmp_path / "Llama-3.2-1B"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert read('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 3}') \
        == Speculation(draft=tn.NGRAM, num_draft_tokens=5, settings=(
            "speculative_decoding.lookup_min_ngram=3", "speculative_decoding.lookup_max_ngram=4"))
    # one bound given: the other the same (vLLM's reading)
    assert read('{"method": "ngram", "prompt_lookup_max": 3}').settings == (
        "speculative_decoding.lookup_min_ngram=3", "speculative_decoding.lookup_max_ngram=3")
    assert read('{"method": "suffix"}') == Speculation(draft=tn.SUFFIX)
    assert read('{"model": "[ngram]", "num_speculative_tokens": 4}') == read('{"method": "[ngram]", "num_speculative_tokens": 4}') \
        == Speculation(draft=tn.NGRAM, num_draft_tokens=4)  # vLLM's older spelling
    for method in ("eagle", "eagle3", "medusa"):
        assert read(json.dumps({"method": method, "model": str(head), "num_speculative_tokens": 3})) == \
            Speculation(head=str(head), num_draft_tokens=3)
    assert read(json.dumps({"method": "draft_model", "model": str(draft)})) == Speculation(draft=str(draft))
    assert read('{"method": "mtp", "num_speculative_tokens": 2}') == Speculation(mtp=True, num_draft_tokens=2)
    assert read(json.dumps({"method": "mimo_mtp", "model": str(draft)})) == Speculation(head=str(draft), mtp=True)
    # no method: a head's config (or an EAGLE in its name) is a head, anything else a draft model
    assert read(json.dumps({"model": str(head)})).head == str(head)
    assert read(json.dumps({"model": str(draft)})).draft == str(draft)
    speculators = tmp_path / "a-speculator"  # the speculators library's layout: its kind named in the config
    speculators.mkdir()
    (speculators / "config.json").write_text(json.dumps({"speculators_model_type": "eagle"}))
    assert read(json.dumps({"model": str(speculators)})).head == str(speculators)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("[1, 2]")  # not a model's config: a draft model, whose load says so
    assert read(json.dumps({"model": str(tmp_path / "odd")})).draft == str(tmp_path / "odd")
    ignored = read(json.dumps({"method": "eagle3", "model": str(head), "draft_tensor_parallel_size": 1,
                               "disable_by_batch_size": 8, "acceptance_method": "rejection_sampler"}))
    assert ignored.ignored == ("disable_by_batch_size", "draft_tensor_parallel_size")


@pytest.mark.parametrize("text, message", [
    ("{not json", "--speculative-config is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 1}', "method 'deepseek_mtp' is not served here"),
    ('{"method": "eagle3"}', "method 'eagle3' needs a 'model'"),
    ('{"method": "ngram", "model": "/m"}', "method 'ngram' takes no 'model'"),
    ('{"num_speculative_tokens": 3}', "give 'method'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_max": 99}', "prompt_lookup_max must be an integer within [1, 16]"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min (4) is above"),
    ('{"method": "eagle", "model": "/h", "prompt_lookup_max": 2}', "prompt_lookup_max is prompt lookup's"),
    ('{"method": "ngram", "acceptance_method": "typical_acceptance_sampler"}', "acceptance_method"),
    ('{"method": "ngram", "posterior_threshold": 0.1}', "'posterior_threshold' is not a setting served here"),
])
def test_what_cannot_be_served_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read(text)


def test_the_launcher_drafts_as_the_config_says_and_refuses_it_beside_its_own_flags(tmp_path, monkeypatch, capsys):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "hidden_size": 8, "vocab_size": 16}))
    rendered, overrides = [], []
    monkeypatch.setattr(launcher.repository, "render", lambda pair, dest: rendered.append(pair) or dest)
    monkeypatch.setattr(launcher.repository, "override", lambda repo, setting: overrides.append(setting))
    monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    base = ["--target", "/w/target", "--run-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        launcher.main([*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 24, '
                                                      '"prompt_lookup_max": 5}', "--max-model-len", "4096"])
    pair = rendered[-1]
    assert (pair.default_draft, pair.default_num_draft_tokens, pair.max_num_draft_tokens, pair.max_context_tokens) \
        == (tn.NGRAM, 24, 24, 4096)
    assert overrides == ["speculative_decoding.lookup_min_ngram=5", "speculative_decoding.lookup_max_ngram=5"]
    with pytest.raises(SystemExit):
        launcher.main([*base, "--speculative-config", json.dumps({"method": "medusa", "model": str(head),
                                                                  "num_speculative_tokens": 3})])
    pair = rendered[-1]
    assert (pair.draft_heads, pair.default_draft, pair.default_num_draft_tokens) == (
        {tn.DEFAULT_HEAD_NAME: str(head)}, tn.DEFAULT_HEAD_NAME, 3)
    for flags, message in (
            (["--draft", "/w/draft"], "both say how to draft"),
            (["--num-draft-tokens", "2"], "both say how to draft")):
        with pytest.raises(SystemExit):
            launcher.parse_args([*base, "--speculative-config", '{"method": "ngram"}', *flags])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.parse_args(["--pair", "tiny", "--speculative-config", '{"method": "ngram"}'])
    assert "needs --target" in capsys.readouterr().err
    # a model's own MTP layer (MiMo's): the target's directory is the head's, or the one the config names
    assert launcher.parse_args([*base, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']
                               ).draft_head == ["/w/target"]
    assert launcher.parse_args([*base, "--speculative-config", '{"method": "mimo_mtp", "model": "/w/mtp"}']
                               ).draft_head == ["/w/mtp"]
    # IBM's MLP speculators are heads here (draft_heads.MlpSpeculator)
    assert launcher.parse_args([*base, "--speculative-config",
                                '{"method": "mlp_speculator", "model": "/m"}']).draft_head == ["/m"]


def test_prompt_lookups_bounds_are_speculative_decodings_parameters(tmp_path):
    repo = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok"), tmp_path / "repo")
    config = (repo / "speculative_decoding" / "config.pbtxt").read_text()
    assert f'key: "lookup_min_ngram", value: {{ string_value: "{tn.LOOKUP_NGRAM[0]}" }}' in config
    assert f'key: "lookup_max_ngram", value: {{ string_value: "{tn.LOOKUP_NGRAM[1]}" }}' in config
    repository.override(repo, "speculative_decoding.lookup_max_ngram=6")
    assert 'key: "lookup_max_ngram", value: { string_value: "6" }' in (repo / "speculative_decoding" / "config.pbtxt").read_text()


def test_a_speculator_given_as_the_target_serves_its_verifier_with_it_as_vllm_does(tmp_path, monkeypatch, capsys):
    """`vllm serve RedHatAI/...speculator.eagle3`: the head's verifier the target, the head its draft, K its
    default proposal method's; a verifier that is not a directory here, or drafting flags beside it, refused."""
    verifier, head = tmp_path / "Llama-3.1-8B-Instruct", tmp_path / "speculator.eagle3"
    verifier.mkdir()
    head.mkdir()
    (verifier / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    config = {"speculators_model_type": "eagle3", "draft_vocab_size": 32000,
              "speculators_config": {"default_proposal_method": "greedy", "proposal_methods": [
                  {"proposal_type": "tree", "speculative_tokens": 7},
                  {"proposal_type": "greedy", "speculative_tokens": 5}],
                  "verifier": {"name_or_path": str(verifier)}}}
    (head / "config.json").write_text(json.dumps(config))
    assert speculator(str(head)) == Speculator(target=str(verifier), head=str(head), num_draft_tokens=5)
    assert speculator(str(verifier)) is None and speculator(str(tmp_path / "none")) is None
    rendered = []
    monkeypatch.setattr(launcher.repository, "render", lambda pair, dest: rendered.append(pair) or dest)
    monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    with pytest.raises(SystemExit):
        launcher.main(["--target", str(head), "--run-dir", str(tmp_path / "run")])
    pair = rendered[-1]
    assert (pair.target_path, pair.tokenizer_path, pair.default_num_draft_tokens) == (str(verifier), str(verifier), 5)
    assert list(pair.draft_heads.values()) == [str(head)] or list(pair.hosted_heads.values()) == [str(head)]
    # the OpenAI API's model is named as the head's directory (vLLM names the path it was given)
    assert launcher.parse_args(["--target", str(head)]).model_name == "speculator.eagle3"
    assert launcher.parse_args(["--target", str(verifier)]).model_name == ""
    with pytest.raises(SystemExit):  # an explicit K wins
        launcher.main(["--target", str(head), "--num-draft-tokens", "2", "--run-dir", str(tmp_path / "run")])
    assert rendered[-1].default_num_draft_tokens == 2
    for argv in (["--draft-head", str(head)], ["--draft", "suffix"]):
        with pytest.raises(SystemExit):
            launcher.parse_args(["--target", str(head), *argv])
        assert "is a draft head with its verifier" in capsys.readouterr().err
    config["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="verifier 'meta-llama/Llama-3.1-8B-Instruct' is not a directory here"):
        speculator(str(head))


def test_sglangs_algorithms_and_tree_shapes_stand_for_this_servers_drafts():
    """SGLang's flags as its published command lines give them: EAGLE-3 with trees 8 wide of 31 nodes, EAGLE-2
    chains, NEXTN (a model's MTP layer) with the target's own path or none, STANDALONE draft models, NGRAM."""
    assert from_sglang("EAGLE3", "/h", num_steps=5, topk=8, num_draft_tokens=32) == Speculation(
        head="/h", num_draft_tokens=31, settings=("speculative_decoding.draft_branches=8",))
    assert from_sglang("EAGLE", "/h", num_steps=3, topk=1, num_draft_tokens=4) == Speculation(head="/h",
                                                                                                num_draft_tokens=3)
    assert from_sglang("eagle", "/h", num_steps=4, topk=2) == Speculation(  # a tree's nodes: steps x width
        head="/h", num_draft_tokens=8, settings=("speculative_decoding.draft_branches=2",))
    assert from_sglang("EAGLE3", "/h", num_draft_tokens=4) == Speculation(head="/h", num_draft_tokens=3)
    assert from_sglang("NEXTN", num_steps=1, topk=1, num_draft_tokens=2) == Speculation(mtp=True, num_draft_tokens=1)
    assert from_sglang("NEXTN", "/m") == Speculation(head="/m", mtp=True)
    assert from_sglang("STANDALONE", "/d", num_steps=5, topk=1) == Speculation(draft="/d", num_draft_tokens=5)
    assert from_sglang("NGRAM", num_draft_tokens=8, topk=4) == Speculation(draft=tn.NGRAM, num_draft_tokens=7)
    assert from_sglang("EAGLE3", "/h", engine=("--speculative-token-map",)).ignored == ("--speculative-token-map",)
    assert from_sglang("EAGLE3", "/h", thresholds=(1.0, 1.0)).head == "/h"  # exact acceptance: SGLang's default
    # NGRAM's match window: prompt lookup's n-grams (SGLang's defaults, 1 and 12, for the one not given)
    assert from_sglang("NGRAM", num_draft_tokens=8, windows=(2, 6)).settings == (
        "speculative_decoding.lookup_min_ngram=2", "speculative_decoding.lookup_max_ngram=6")
    assert from_sglang("NGRAM", windows=(None, 4)).settings[0] == "speculative_decoding.lookup_min_ngram=1"
    assert from_sglang("NGRAM", windows=(3, None)).settings[1] == "speculative_decoding.lookup_max_ngram=12"


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithm": "LOOKAHEAD"}, "--speculative-algorithm 'LOOKAHEAD' is not served here"),
    ({"algorithm": "EAGLE3"}, "EAGLE3 needs --speculative-draft-model-path"),
    ({"algorithm": "STANDALONE"}, "STANDALONE needs --speculative-draft-model-path"),
    ({"algorithm": "NGRAM", "path": "/d"}, "NGRAM takes no --speculative-draft-model-path"),
    ({"algorithm": "EAGLE", "path": "/h", "topk": 9}, "--speculative-eagle-topk 9: trees here are at most 8 wide"),
    ({"algorithm": "EAGLE", "path": "/h", "num_steps": 0}, "--speculative-num-steps must be at least 1"),
    ({"algorithm": "EAGLE", "path": "/h", "num_draft_tokens": 1}, "--speculative-num-draft-tokens must be at least 2"),
    ({"algorithm": "EAGLE", "path": "/h", "thresholds": (0.5, None)}, "--speculative-accept-threshold-single 0.5"),
    ({"algorithm": "EAGLE", "path": "/h", "thresholds": (None, 0.9)}, "--speculative-accept-threshold-acc 0.9"),
    ({"algorithm": "NGRAM", "windows": (1, 17)}, "--speculative-ngram-max-match-window-size 17: prompt lookup"),
    ({"algorithm": "NGRAM", "windows": (8, 4)}, "--speculative-ngram-min-match-window-size 8 is above"),
    ({"algorithm": "EAGLE", "path": "/h", "windows": (2, None)}, "--speculative-ngram-min-match-window-size is NGRAM's"),
])
def test_what_sglangs_flags_ask_and_cannot_be_served_is_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_sglang(**kwargs)


def test_the_launcher_reads_sglangs_flags_and_refuses_them_beside_its_own_or_vllms(capsys):
    base = ["--target", "/w/target"]
    args = launcher.parse_args([*base, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/h",
                                "--speculative-num-steps", "5", "--speculative-eagle-topk", "8",
                                "--speculative-num-draft-tokens", "32", "--speculative-draft-attention-backend", "fa3"])
    assert (args.draft_head, args.num_draft_tokens, args.max_num_draft_tokens) == (["/h"], 31, 31)
    assert args.set == ["speculative_decoding.draft_branches=8"]
    assert args.speculative_ignored == ("--speculative-draft-attention-backend",)
    # its older spellings (--speculative-algo, an abbreviation argparse reads; --speculative-draft); NEXTN: the target's
    args = launcher.parse_args([*base, "--speculative-algo", "NEXTN", "--speculative-num-steps", "3",
                                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"])
    assert (args.draft_head, args.num_draft_tokens, args.set) == (["/w/target"], 3, [])
    args = launcher.parse_args([*base, "--speculative-algorithm", "STANDALONE", "--speculative-draft", "/d"])
    assert (args.draft, args.draft_head) == ("/d", [])
    # SGLang's names of the target and the context
    args = launcher.parse_args(["--model-path", "/w/target", "--context-length", "8192", "--speculative-algorithm",
                                "NEXTN"])
    assert (args.target, args.max_context_tokens, args.draft_head) == ("/w/target", 8192, ["/w/target"])
    for flags, message in (
            (["--speculative-num-steps", "3"], "--speculative-num-steps need --speculative-algorithm"),
            (["--speculative-algorithm", "NGRAM", "--draft", "/d"], "both say how to draft"),
            (["--speculative-algorithm", "NGRAM", "--speculative-config", '{"method": "ngram"}'],
             "(SGLang's) both say how to draft"),
            (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/h",
              "--speculative-accept-threshold-acc", "0.5"], "changes the output's distribution")):
        with pytest.raises(SystemExit):
            launcher.parse_args([*base, *flags])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.parse_args(["--pair", "tiny", "--speculative-algorithm", "NGRAM"])
    assert "SGLang's --speculative-algorithm needs --target" in capsys.readouterr().err
    # NGRAM's window as prompt lookup's n-grams; its trie's own shape logged
    args = launcher.parse_args([*base, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
                                "--speculative-ngram-min-match-window-size", "2",
                                "--speculative-ngram-max-match-window-size", "6",
                                "--speculative-ngram-max-bfs-breadth", "10", "--speculative-ngram-capacity", "1000"])
    assert (args.draft, args.num_draft_tokens) == (tn.NGRAM, 7)
    assert args.set == ["speculative_decoding.lookup_min_ngram=2", "speculative_decoding.lookup_max_ngram=6"]
    assert args.speculative_ignored == ("--speculative-ngram-max-bfs-breadth", "--speculative-ngram-capacity")
