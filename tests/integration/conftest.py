"""A real tritonserver with the tiny pair, started once per test session through the project's launcher."""

import pytest

from .helpers import start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("triton"))
    yield srv
    stop_server(srv)
