"""A real tritonserver with the tiny pair, started once per test session through the project's launcher."""

import warnings

import pytest

from specdec.serving import pairs, repository

from .helpers import check_retired, start_server, stop_server


@pytest.fixture(scope="session", autouse=True)
def retired_servers_stop_cleanly():
    """The modules' servers stop on threads (helpers.retire_server); at the end every one must have."""
    yield
    check_retired()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """With the test drafts (`draft_model_exact`, `draft_model_random`) beside `draft_model`."""
    tmp_path = tmp_path_factory.mktemp("triton")
    # (and vLLM's runtime LoRA endpoints, over the pair's directory of adapters: test_lora.py)
    srv = start_server(tmp_path, repository=repository.render(pairs.tiny_pair(test_drafts=True), tmp_path / "repo"),
                       launcher_args=("--allow-runtime-lora-updating",))
    yield srv
    # Strict here: nothing pending and every stub gone. A clean exit code is asserted by
    # test_lifecycle.py on a server of its own; after this session's hundreds of requests, cancellations
    # and client kills, Triton 24.10 has been seen (rarely) to time out unloading a model.
    code = stop_server(srv, require_clean_exit=False)
    if code != 0:
        warnings.warn(f"tritonserver exited with {code} after the session; log: {srv.log_path}")
