"""The real default pair (SmolLM2-135M-Instruct target) served by its own tritonserver: speculative greedy
output equals target-only output, for the default draft (prompt lookup, adaptive K), prompt lookup first and
the shipped EAGLE-3 head otherwise (ngram+eagle3: the head's trees 3 wide or its chains), the draft model and
the head alone (eagle3), as chains and as trees (a request's num_draft_branches)."""

import json

import pytest

from specdec import tensor_names as tn
from specdec.serving.pairs import REPO_ROOT

from .helpers import grpc_stream, retire_server, start_server

pytestmark = pytest.mark.integration

PROMPTS = [json.loads(line)["prompt"] for line in (REPO_ROOT / "bench" / "prompts_grounded.jsonl").read_text().splitlines()[:2]]
PROMPTS += [json.loads(line)["prompt"] for line in (REPO_ROOT / "bench" / "prompts_open.jsonl").read_text().splitlines()[:1]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("triton-default"), pair="default")
    yield srv
    retire_server(srv, require_clean_exit=False)


@pytest.fixture(scope="module")
def target_only(default_server):
    return {prompt: grpc_stream(default_server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=0)
            for prompt in PROMPTS}


@pytest.mark.parametrize("draft, k, adaptive, branches", [
    (None, None, None, None), ("ngram+eagle3", None, None, None), ("draft_model", 3, False, None),
    ("eagle3", 3, False, 1), ("eagle3", 8, False, None)])  # None: the default (ngram)
def test_real_pair_speculative_greedy_equals_target_only(default_server, target_only, draft, k, adaptive, branches):
    drafted = accepted = 0
    trees = default_server.metric("specdec_tree_rounds_total")
    for prompt in PROMPTS:
        base = target_only[prompt]
        spec = grpc_stream(default_server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=k,
                           draft_model=draft, adaptive_draft=adaptive, num_draft_branches=branches)
        assert spec[tn.TEXT_OUTPUT] == base[tn.TEXT_OUTPUT], prompt
        assert spec[tn.NUM_OUTPUT_TOKENS] == base[tn.NUM_OUTPUT_TOKENS]
        assert base[tn.TOTAL_DRAFT_TOKENS] == 0
        drafted += spec[tn.TOTAL_DRAFT_TOKENS]
        accepted += spec[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]
    assert drafted > 0 and accepted > 0  # speculation really ran, and some drafts were accepted
    trees = default_server.metric("specdec_tree_rounds_total") - trees
    if draft == "eagle3":  # a fixed K: every round of the head's a tree (3 wide by default), or a chain when asked
        assert (trees > 0) == (branches != 1), trees


def test_num_draft_branches_over_the_servers_is_refused_by_name(default_server):
    from .helpers import GenerationError

    with pytest.raises(GenerationError, match=tn.NUM_DRAFT_BRANCHES):
        grpc_stream(default_server.grpc_url, PROMPTS[0], max_tokens=4, num_draft_branches=4)
    # and the server keeps serving
    assert grpc_stream(default_server.grpc_url, PROMPTS[0], max_tokens=4)[tn.NUM_OUTPUT_TOKENS] == 4


def test_readme_examples_show_what_the_server_answers(default_server):
    """The README's real-output examples (written by `make readme-examples`) cannot go stale: the same
    greedy requests still get the same text."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_examples", REPO_ROOT / "bench" / "readme_examples.py")
    examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples)
    _, answer = examples.http_example(default_server.http_url)
    shown = examples.readme_http_answer()
    for field in (tn.TEXT_OUTPUT, tn.FINISH_REASON, tn.NUM_INPUT_TOKENS, tn.NUM_OUTPUT_TOKENS):
        assert answer[field] == shown[field], field
    _, chat = examples.openai_example(default_server.openai_url)
    shown = examples.readme_openai_answer()
    assert chat["choices"][0]["message"] == shown["choices"][0]["message"]
    assert chat["usage"] == shown["usage"] and chat["model"] == shown["model"]
    cli_text = examples.last_fence(examples.cli_example(default_server.grpc_url)).splitlines()[0]
    assert cli_text == examples.last_fence(examples.readme_block("cli")).splitlines()[0]
