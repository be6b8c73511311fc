"""The init container's download: once, keyed by the repositories, never trusting a half-done download."""

import pytest

from specdec.serving import fetch as fetch_module
from specdec.serving.fetch import MARKER, fetch


class Downloads:
    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on

    def __call__(self, repo_id, revision, local_dir, token):
        if repo_id == self.fail_on:
            raise OSError("network")
        self.calls.append((repo_id, revision, local_dir.name, token))
        local_dir.mkdir(parents=True, exist_ok=True)
        (local_dir / "config.json").write_text(repo_id)


def test_downloads_once_then_skips(tmp_path):
    first = Downloads()
    assert fetch(tmp_path, "org/target@v1", "org/draft", "tok", download=first)
    assert first.calls == [("org/target", "v1", "target", "tok"), ("org/draft", None, "draft", "tok")]
    again = Downloads()
    assert not fetch(tmp_path, "org/target@v1", "org/draft", download=again) and again.calls == []


def test_a_changed_repository_downloads_again(tmp_path):
    fetch(tmp_path, "org/target", "org/draft", download=Downloads())
    changed = Downloads()
    assert fetch(tmp_path, "org/other-target", "org/draft", download=changed)
    assert [c[0] for c in changed.calls] == ["org/other-target", "org/draft"]
    assert (tmp_path / "target" / "config.json").read_text() == "org/other-target"


def test_a_failed_download_leaves_no_marker(tmp_path):
    fetch(tmp_path, "org/target", "org/draft", download=Downloads())
    with pytest.raises(OSError):
        fetch(tmp_path, "org/target", "org/new-draft", download=Downloads(fail_on="org/new-draft"))
    assert not (tmp_path / MARKER).exists()  # the next start retries instead of serving a mixed pair


def test_a_speculator_alone_fetches_the_verifier_it_names_as_the_target(tmp_path, monkeypatch, capsys):
    """`vllm serve RedHatAI/...speculator.eagle3`: TARGET_REPO empty, DRAFT_REPO a head in the speculators
    layout; its verifier is fetched into target/. A draft that names none is refused, leaving no marker."""
    import json

    class Speculators(Downloads):
        def __call__(self, repo_id, revision, local_dir, token):
            super().__call__(repo_id, revision, local_dir, token)
            if repo_id.endswith("speculator.eagle3"):
                (local_dir / "config.json").write_text(json.dumps({
                    "speculators_model_type": "eagle3",
                    "speculators_config": {"verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}}}))

    calls = Speculators()
    assert fetch(tmp_path, "", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3@abc", download=calls)
    assert calls.calls == [("RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", "abc", "draft", None),
                           ("meta-llama/Llama-3.1-8B-Instruct", None, "target", None)]
    assert not fetch(tmp_path, "", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3@abc", download=Speculators())
    with pytest.raises(ValueError, match="TARGET_REPO is not set and DRAFT_REPO org/draft names no verifier"):
        fetch(tmp_path, "", "org/draft", download=Downloads())
    assert not (tmp_path / MARKER).exists()
    monkeypatch.setenv("MODELS_DIR", str(tmp_path))
    for name in ("TARGET_REPO", "DRAFT_REPO", "LORA_REPOS"):
        monkeypatch.delenv(name, raising=False)
    assert fetch_module.main() == 2 and "TARGET_REPO is not set" in capsys.readouterr().err


def test_prompt_lookup_pairs_need_no_draft(tmp_path):
    (tmp_path / "draft").mkdir()
    calls = Downloads()
    fetch(tmp_path, "org/target", "", download=calls)
    assert [c[0] for c in calls.calls] == ["org/target"] and not (tmp_path / "draft").exists()


def test_lora_adapters_are_fetched_into_lora_and_one_no_longer_named_is_removed(tmp_path):
    calls = Downloads()
    assert fetch(tmp_path, "org/target", "", download=calls, lora={"sql": "org/sql-lora@v2", "team/chat": "org/chat"})
    assert [(c[0], c[1]) for c in calls.calls] == [("org/target", None), ("org/sql-lora", "v2"), ("org/chat", None)]
    assert (tmp_path / "lora" / "sql" / "config.json").read_text() == "org/sql-lora"
    assert (tmp_path / "lora" / "team" / "chat" / "config.json").is_file()
    assert not fetch(tmp_path, "org/target", "", download=Downloads(), lora={"team/chat": "org/chat", "sql": "org/sql-lora@v2"})
    assert fetch(tmp_path, "org/target", "", download=Downloads(), lora={"team/chat": "org/chat"})
    assert not (tmp_path / "lora" / "sql").exists() and (tmp_path / "lora" / "team" / "chat").is_dir()
    with pytest.raises(ValueError, match="would leave"):
        fetch(tmp_path, "org/target", "", download=Downloads(), lora={"a/../../target": "org/evil"})
    assert (tmp_path / "target" / "config.json").read_text() == "org/target"


def test_lora_repos_come_from_the_environment_and_a_bad_list_is_refused(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(fetch_module, "fetch", lambda *args, **kwargs: seen.update(kwargs) or True)
    monkeypatch.setenv("TARGET_REPO", "org/target")
    monkeypatch.setenv("MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("LORA_REPOS", "sql=org/sql-lora,chat=org/chat@main")
    assert fetch_module.main() == 0 and seen["lora"] == {"sql": "org/sql-lora", "chat": "org/chat@main"}
    monkeypatch.setenv("LORA_REPOS", "sql")
    assert fetch_module.main() == 2 and "LORA_REPOS: NAME=DIRECTORY pairs" in capsys.readouterr().err
