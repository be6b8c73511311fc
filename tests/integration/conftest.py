"""A real tritonserver with the tiny pair, started once per test session through the project's launcher."""

import re
import time
import warnings

import pytest

from specdec.serving import pairs, repository
from specdec.serving.healthcheck import not_ready

from .helpers import READY_TIMEOUT_S, check_retired, start_server, stop_server


@pytest.fixture(scope="session", autouse=True)
def retired_servers_stop_cleanly():
    """The modules' servers stop on threads (helpers.retire_server); at the end every one must have."""
    yield
    check_retired()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """With the test drafts (`draft_model_exact`, `draft_model_random`) beside `draft_model`."""
    tmp_path = tmp_path_factory.mktemp("triton")
    # (and vLLM's runtime LoRA endpoints, over the pair's directory of adapters: test_lora.py; clients'
    # profiles: test_openai_api.py)
    srv = start_server(tmp_path, repository=repository.render(pairs.tiny_pair(test_drafts=True), tmp_path / "repo"),
                       launcher_args=("--allow-runtime-lora-updating",
                                      "--torch-profiler-dir", str(tmp_path / "traces")))
    yield srv
    # Strict here: nothing pending and every stub gone. A clean exit code is asserted by
    # test_lifecycle.py on a server of its own; after this session's hundreds of requests, cancellations
    # and client kills, Triton 24.10 has been seen (rarely) to time out unloading a model.
    code = stop_server(srv, require_clean_exit=False)
    if code != 0:
        warnings.warn(f"tritonserver exited with {code} after the session; log: {srv.log_path}")


@pytest.fixture(autouse=True)
def session_server_serving(request):
    """A test on the session's server starts on a serving one, and a heal during it is reported.

    Triton 24.10 has crashed, rarely, under a test's load (seen in CI during Locust's flood of refused
    requests: every later test on this server failed on a refused connection). The launcher restarts a
    crashed server by design (deployment.md, self-healing); the next test waits for it (the readiness the
    launcher's endpoint answers, healthcheck.not_ready; READY_TIMEOUT_S at most) instead of failing on the
    way back, and the heal's log lines are a warning naming the test it happened in (the session's summary
    lists it)."""
    if "server" not in request.fixturenames:
        yield
        return
    srv = request.getfixturevalue("server")
    deadline = time.monotonic() + READY_TIMEOUT_S
    # A server that reported a fatal signal may answer health checks until the launcher sees it exit
    # (server_process.py): after one, the launcher's line that the restarted server is ready is awaited too.
    while (state := not_ready(srv.http_port, openai_port=srv.openai_port)) is not None or crashed_unhealed(srv):
        if time.monotonic() > deadline or srv.process.poll() is not None:
            pytest.fail(f"the session's server is not serving: {state}; log {srv.log_path}:\n{srv.log_tail()}")
        time.sleep(0.5)
    offset = srv.log_path.stat().st_size
    yield
    with open(srv.log_path, "rb") as log:
        log.seek(offset)
        during = log.read().decode(errors="replace")
    if DOWN.search(during):  # (a stub a test kills on purpose is reloaded in place: no restart, no warning)
        healing = [line for line in during.splitlines() if DOWN.match(line) or "watchdog:" in line]
        warnings.warn(f"the session's server crashed or was restarted during {request.node.nodeid}:\n"
                      + "\n".join(healing))


# A crash (a fatal signal's line, the launcher's "tritonserver <crash>; restarting it") or a hang's restart,
# and the launcher's line once the restarted server serves.
DOWN = re.compile(r"^(Signal \((4|6|7|8|11)\) received|\[specdec\] watchdog: (tritonserver (?!restarted)|restarting))",
                  re.MULTILINE)
BACK = "[specdec] watchdog: tritonserver restarted and ready"


def crashed_unhealed(srv) -> bool:
    """Whether the log's last crash or restart has no BACK line after it (in the log's tail: a restart's
    lines are all within it)."""
    with open(srv.log_path, "rb") as log:
        log.seek(max(0, log.seek(0, 2) - 256_000))
        text = log.read().decode(errors="replace")
    down = [match.start() for match in DOWN.finditer(text)]
    return bool(down) and down[-1] > text.rfind(BACK)
