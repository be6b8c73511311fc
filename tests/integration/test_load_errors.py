"""A wrong path or parameter fails the model's load with a message naming it (real tritonserver)."""

import dataclasses
import subprocess

import pytest

from specdec.serving import pairs, repository
from specdec.serving.launcher import server_command, server_env, triton_layout

from specdec.serving.server import free_ports

pytestmark = pytest.mark.integration


def load_only(tmp_path, pair, model: str, edit=None) -> subprocess.CompletedProcess:
    """Start tritonserver loading one model of the rendered repository; it exits when the load fails."""
    repo = repository.render(pair, tmp_path / "repo")
    if edit:
        edit(repo)
    layout = triton_layout(tmp_path)
    command = server_command(layout, repo, *free_ports(3)) + ["--model-control-mode=explicit", f"--load-model={model}"]
    return subprocess.run(command, env=server_env(layout), capture_output=True, text=True, timeout=180)


def test_missing_model_path_fails_at_load_naming_it(tmp_path):
    pair = dataclasses.replace(pairs.tiny_pair(), target_path="/nonexistent/target-weights")
    result = load_only(tmp_path, pair, "target_model")
    assert result.returncode != 0
    assert "model_path '/nonexistent/target-weights' does not exist" in result.stdout + result.stderr


def test_bad_parameter_value_fails_at_load_naming_it(tmp_path):
    def edit(repo):
        cfg = repo / "speculative_decoding" / "config.pbtxt"
        cfg.write_text(repository.set_parameter(cfg.read_text(), "default_num_draft_tokens", "lots"))

    result = load_only(tmp_path, pairs.tiny_pair(), "speculative_decoding", edit)
    assert result.returncode != 0
    assert "parameter 'default_num_draft_tokens' must be an integer" in result.stdout + result.stderr


@pytest.mark.parametrize("value, message", [("many", "must be an integer, got 'many'"),
                                            ("0", "must be within [1, None], got 0")])
def test_a_bad_torch_threads_fails_the_model_at_load_naming_it(tmp_path, value, message):
    def edit(repo):
        cfg = repo / "target_model" / "config.pbtxt"
        cfg.write_text(repository.set_parameter(cfg.read_text(), "torch_threads", value))

    result = load_only(tmp_path, pairs.tiny_pair(), "target_model", edit)
    assert result.returncode != 0
    assert f"parameter 'torch_threads' {message}" in result.stdout + result.stderr


def test_a_skip_draft_with_layers_it_cannot_skip_fails_at_load_naming_them(tmp_path):
    # the tiny target has 2 layers: neither is an intermediate one
    pair = dataclasses.replace(pairs.tiny_pair(), skip_drafts={"draft_skip": "1"})
    result = load_only(tmp_path, pair, "draft_skip")
    assert result.returncode != 0
    assert "draft_skip: parameter 'skip_layers': layers [1] cannot be skipped" in result.stdout + result.stderr
