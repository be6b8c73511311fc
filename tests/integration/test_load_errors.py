"""A wrong path or parameter fails the model's load with a message naming it (real tritonserver).

One tritonserver loads every broken model of this file at once (each a copy of a model of the tiny pair's
repository with one thing wrong, under a name of its own) and exits when the loads fail: a server per case
cost the suite ten seconds each, most of it the stubs' imports, which run side by side here."""

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from transformers import LlamaConfig

from specdec.engine.draft_heads import EAGLE, random_head, save_head
from specdec.serving import pairs, repository
from specdec.serving.launcher import server_command, server_env, triton_layout

from specdec.serving.server import free_ports

pytestmark = pytest.mark.integration


def _copy(repo, model: str, name: str, key: str, value: str) -> str:
    """`model` under another `name`, with parameter `key` set to `value`."""
    shutil.copytree(repo / model, repo / name, symlinks=True)
    cfg = repo / name / "config.pbtxt"
    cfg.write_text(re.sub(r'^name: "[^"]*"', f'name: "{name}"', cfg.read_text(), count=1, flags=re.M))
    repository.override(repo, f"{name}.{key}={value}")
    return name


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, str]:
    """{model: what tritonserver printed about its load}, for every broken model; the server exited non-zero."""
    tmp_path = tmp_path_factory.mktemp("load-errors")
    # the tiny target has 2 layers: neither is an intermediate one, so layer 1 cannot be skipped
    pair = dataclasses.replace(pairs.tiny_pair(), skip_drafts={"draft_skip": "1"}, orchestrator_instances=1)
    repo = repository.render(pair, tmp_path / "repo")
    # Generation configs the orchestrator cannot read (before its own parameter is broken below)
    bad_json = tmp_path / "bad-generation-config"
    bad_json.mkdir()
    (bad_json / "generation_config.json").write_text("{not json")
    wide = tmp_path / "wide-generation-config"
    wide.mkdir()
    (wide / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10 ** 6]}))
    generation = [_copy(repo, "speculative_decoding", "generation_unreadable", "generation_config", str(bad_json)),
                  _copy(repo, "speculative_decoding", "generation_wide", "generation_config", str(wide)),
                  _copy(repo, "speculative_decoding", "lookup_inverted", "lookup_max_ngram", "1")]
    repository.override(repo, "speculative_decoding.default_num_draft_tokens=lots")
    models = [*generation, "speculative_decoding", "draft_skip",
              _copy(repo, "target_model", "target_missing", "model_path", "/nonexistent/target-weights"),
              _copy(repo, "target_model", "target_threads_many", "torch_threads", "many"),
              _copy(repo, "target_model", "target_threads_0", "torch_threads", "0"),
              _copy(repo, "target_model", "target_small_pool", "kv_pool_tokens", "64")]
    repository.override(repo, "target_small_pool.executor=static")
    # A draft whose tokenizer numbers two tokens the other way round (its weights the tiny draft's).
    renumbered = tmp_path / "renumbered-draft"
    renumbered.mkdir()
    draft = Path(pair.draft_paths["draft_model"])
    for item in draft.iterdir():
        if item.name != "tokenizer.json":
            (renumbered / item.name).symlink_to(item)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (renumbered / "tokenizer.json").write_text(json.dumps(tokenizer))
    models.append(_copy(repo, "draft_model", "draft_renumbered", "model_path", str(renumbered)))
    # A head made for another target (its own repository renders it; its model directory joins this one).
    other = LlamaConfig(vocab_size=1000, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    head = save_head(random_head(EAGLE, other), tmp_path / "wrong-head")
    heads = repository.render(dataclasses.replace(pairs.tiny_pair(), draft_heads={"head_wrong": str(head)}),
                              tmp_path / "head-repo")
    shutil.copytree(heads / "head_wrong", repo / "head_wrong", symlinks=True)
    models.append("head_wrong")
    # Chat templates: one that does not compile (beside the model's config, as the launcher writes its own) and
    # one that is not there.
    models.append(_copy(repo, "preprocessing", "template_broken", "chat_template", "chat_template.jinja"))
    (repo / "template_broken" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    models.append(_copy(repo, "preprocessing", "template_missing", "chat_template", "/nonexistent/template.jinja"))
    models.append(_copy(repo, "preprocessing", "template_parts", "chat_template_content_format", "parts"))
    layout = triton_layout(tmp_path)
    command = server_command(layout, repo, *free_ports(3)) + ["--model-control-mode=explicit",
                                                              *(f"--load-model={model}" for model in models)]
    result = subprocess.run(command, env=server_env(layout), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, "tritonserver came up with broken models"
    output = (result.stdout + result.stderr).splitlines()
    return {"head path": str(head),
            **{model: "\n".join(line for line in output if model in line) for model in models}}


def test_missing_model_path_fails_at_load_naming_it(broken):
    assert "model_path '/nonexistent/target-weights' does not exist" in broken["target_missing"]


def test_bad_parameter_value_fails_at_load_naming_it(broken):
    assert "parameter 'default_num_draft_tokens' must be an integer" in broken["speculative_decoding"]


@pytest.mark.parametrize("model, message", [("target_threads_many", "must be an integer, got 'many'"),
                                            ("target_threads_0", "must be within [1, None], got 0")])
def test_a_bad_torch_threads_fails_the_model_at_load_naming_it(broken, model, message):
    assert f"parameter 'torch_threads' {message}" in broken[model]


def test_a_skip_draft_with_layers_it_cannot_skip_fails_at_load_naming_them(broken):
    assert "draft_skip: parameter 'skip_layers': layers [1] cannot be skipped" in broken["draft_skip"]


def test_a_pool_smaller_than_the_context_fails_the_load_naming_it(broken):
    assert "cannot hold one sequence of max_context=" in broken["target_small_pool"]
    assert "raise kv_pool_tokens" in broken["target_small_pool"]


def test_a_draft_that_numbers_tokens_differently_is_refused_at_load_naming_both(broken):
    message = broken["draft_renumbered"]
    assert "the draft's tokenizer" in message and "renumbered-draft" in message and "differs from the target's" in message
    assert "2 mapped differently" in message


def test_a_head_made_for_another_target_is_refused_at_load_naming_both(broken):
    message = broken["head_wrong"]
    assert f"the draft head {broken['head path']} does not fit the target {pairs.tiny_pair().target_path}" in message
    assert "vocabulary has 1000 tokens" in message


def test_a_chat_template_that_does_not_compile_or_is_not_there_fails_the_load_naming_it(broken):
    assert ("template_broken: parameter 'chat_template': the chat template fails on a one-message conversation "
            "(TemplateSyntaxError") in broken["template_broken"]
    assert ("template_missing: parameter 'chat_template': '/nonexistent/template.jinja' is not a file"
            in broken["template_missing"])
    assert ("template_parts: parameter 'chat_template_content_format' must be one of auto, string, openai, got "
            "'parts'") in broken["template_parts"]


def test_prompt_lookups_bounds_the_wrong_way_round_fail_the_load_naming_them(broken):
    assert "lookup_inverted: parameter 'lookup_max_ngram' must be within [2, 16], got 1" in broken["lookup_inverted"]


def test_a_generation_config_the_orchestrator_cannot_use_fails_the_load_naming_it(broken):
    assert ("generation_unreadable: parameter 'generation_config': cannot read" in broken["generation_unreadable"])
    assert ("generation_wide: parameter 'generation_config': eos_token_id [2, 1000000] is not token ids within"
            in broken["generation_wide"])
