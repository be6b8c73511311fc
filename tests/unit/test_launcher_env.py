"""The launcher's environment for tritonserver and its stubs: its defaults, and the user's values winning."""

from pathlib import Path

from specdec.serving import launcher


def test_stub_defaults_apply_and_a_users_value_wins(monkeypatch):
    layout = launcher.ServerLayout(Path("/bin/tritonserver"), Path("/backends"), "/lib-x")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = launcher.server_env(layout)
    assert env["GOMP_SPINCOUNT"] == launcher.STUB_ENV_DEFAULTS["GOMP_SPINCOUNT"]
    assert env["LD_LIBRARY_PATH"] == "/lib-x"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert launcher.server_env(layout)["GOMP_SPINCOUNT"] == "300000"
