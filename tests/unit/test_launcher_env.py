"""The launcher's environment for tritonserver and its stubs: its defaults, and the user's values winning."""

from pathlib import Path

import pytest

from specdec.serving import launcher


def test_stub_defaults_apply_and_a_users_value_wins(monkeypatch):
    layout = launcher.ServerLayout(Path("/bin/tritonserver"), Path("/backends"), "/lib-x")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = launcher.server_env(layout)
    assert env["GOMP_SPINCOUNT"] == launcher.STUB_ENV_DEFAULTS["GOMP_SPINCOUNT"]
    assert env["LD_LIBRARY_PATH"] == "/lib-x"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert launcher.server_env(layout)["GOMP_SPINCOUNT"] == "300000"


def _fake_control(tmp_path, exit_code=0):
    """A stand-in nvidia-cuda-mps-control that records each call: its arguments, its stdin and the pipe
    directory it was given."""
    calls = tmp_path / "calls"
    script = tmp_path / "bin" / "nvidia-cuda-mps-control"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\n"
                      f"echo \"args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$(cat)\" >> {calls}\n"
                      f"[ {exit_code} = 0 ] || echo 'cannot start' >&2\n"
                      f"exit {exit_code}\n")
    script.chmod(0o755)
    return script, calls


def test_the_mps_daemon_gets_directories_of_its_own_and_quits_when_told(tmp_path, monkeypatch):
    from specdec.serving import mps

    script, calls = _fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    daemon = mps.MpsDaemon(tmp_path / "run" / "mps")
    daemon.start()
    pipe, log = daemon.env["CUDA_MPS_PIPE_DIRECTORY"], daemon.env["CUDA_MPS_LOG_DIRECTORY"]
    assert Path(pipe).is_dir() and Path(log).is_dir() and pipe.startswith(str(tmp_path / "run" / "mps"))
    # the server's processes are pointed at the same directories
    layout = launcher.ServerLayout(Path("/bin/tritonserver"), Path("/backends"), "/lib-x")
    env = launcher.server_env(layout, daemon.env)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe and env["CUDA_MPS_LOG_DIRECTORY"] == log
    daemon.stop()
    daemon.stop()  # once only
    lines = calls.read_text().splitlines()
    assert lines == [f"args=-d pipe={pipe} log={log} stdin=", f"args= pipe={pipe} log={log} stdin=quit"]
    assert Path(pipe).is_dir()  # a directory it was given stays
    # by default a new local directory per launch, removed at stop
    own = mps.MpsDaemon()
    assert own.directory.name.startswith("specdec-mps-") and own.directory.is_dir()
    own.start()
    own.stop()
    assert not own.directory.exists()


def test_mps_without_its_control_binary_or_with_a_failing_one_is_refused_with_why(tmp_path, monkeypatch):
    import pytest

    from specdec.serving import mps

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(mps.MpsError, match="nvidia-cuda-mps-control not found on PATH"):
        mps.MpsDaemon(tmp_path / "mps").start()
    script, _ = _fake_control(tmp_path, exit_code=3)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    daemon = mps.MpsDaemon(tmp_path / "mps")
    with pytest.raises(mps.MpsError, match="-d exited with 3: cannot start"):
        daemon.start()
    daemon.stop()  # nothing started: nothing to tell


def test_a_head_given_on_the_command_line_is_the_default_draft_beside_the_pairs_own(tmp_path):
    """--draft-head DIR beside a pair that serves a head of its own (the default pair's eagle3): the head
    given becomes the default draft, both are served, and a name taken is refused."""
    import pytest

    from specdec.serving import pairs

    head = tmp_path / "mine"
    head.mkdir()
    (head / "config.json").write_text("{}")
    pair = pairs.PairSpec(name="p", target_path="t", tokenizer_path="t", draft_heads={"eagle3": "/shipped"},
                          default_draft="ngram")
    served = launcher.with_heads(pair, [str(head)])
    assert served.default_draft == "draft_head" and served.draft_heads == {"eagle3": "/shipped", "draft_head": str(head)}
    assert launcher.with_heads(pair, []).default_draft == "ngram"
    assert launcher.with_heads(pair, [], "eagle3").default_draft == "eagle3"
    with pytest.raises(ValueError, match="'eagle3' is taken"):
        launcher.with_heads(pair, [f"eagle3={head}"])


def test_the_allocator_is_tcmalloc_for_cpu_models_where_installed_and_a_users_choice_wins(tmp_path):
    from specdec.serving import allocator

    lib = "/lib/libtcmalloc_minimal.so.4"
    found, missing = (lambda: lib), (lambda: "")
    env, line = allocator.environment("auto", on_cpu=True, environ={}, find=found)
    assert env["LD_PRELOAD"] == lib and lib in line
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == allocator.QUIET["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]
    # a user's preload is kept after it, their threshold wins
    env, _ = allocator.environment("auto", True, {"LD_PRELOAD": "/x/libfoo.so",
                                                  "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, found)
    assert env["LD_PRELOAD"] == f"{lib}:/x/libfoo.so" and env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
    # auto: nothing on GPUs, nothing where none is installed (the line says how), nothing over a user's allocator
    assert allocator.environment("auto", False, {}, found)[0] == {}
    env, line = allocator.environment("auto", True, {}, missing)
    assert env == {} and allocator.INSTALL_HINT in line
    assert allocator.environment("auto", True, {"LD_PRELOAD": "/y/libjemalloc.so.2"}, found)[0] == {}
    # tcmalloc: on GPUs too, over another allocator; an error naming the flag where none is installed
    env, _ = allocator.environment("tcmalloc", False, {"LD_PRELOAD": "/y/libjemalloc.so.2 /x/a.so"}, found)
    assert env["LD_PRELOAD"] == f"{lib}:/x/a.so"
    with pytest.raises(ValueError, match="--allocator tcmalloc"):
        allocator.environment("tcmalloc", True, {}, missing)
    # glibc: an inherited allocator taken out, the rest kept
    assert allocator.environment("glibc", True, {"LD_PRELOAD": f"{lib}:/x/a.so"}, found)[0] == {"LD_PRELOAD": "/x/a.so"}
    with pytest.raises(ValueError, match="--allocator 'mimalloc'"):
        allocator.environment("mimalloc", True, {}, found)
    # found on disk; the repository's target_model placement read from its config
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc((str(tmp_path / "none"), str(tmp_path))) == str(tmp_path / "libtcmalloc.so.4")
    assert allocator.find_tcmalloc((str(tmp_path / "none"),)) == ""
    (tmp_path / "target_model").mkdir()
    device = 'parameters {{ key: "device", value: {{ string_value: "{}" }} }}'.format
    (tmp_path / "target_model" / "config.pbtxt").write_text(device("cpu"))
    assert allocator.models_on_cpu(tmp_path)
    (tmp_path / "target_model" / "config.pbtxt").write_text(device("cuda"))
    assert not allocator.models_on_cpu(tmp_path) and not allocator.models_on_cpu(tmp_path / "none")


def test_the_scratch_of_a_run_directorys_last_server_is_removed_once_it_no_longer_runs(tmp_path, monkeypatch):
    """A launcher killed outright leaves its server's scratch directories; the next launcher of the run directory
    removes those of the server its PID file names, if that no longer runs, and nothing else (another PID
    namespace's servers share /dev/shm under `--ipc=host`)."""
    import os
    import subprocess

    from specdec.triton import execute_clock
    from specdec.triton.admission import cancellation, kv_room, sequence_slots

    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setattr(cancellation, "scratch_base", lambda: base)
    for module in (kv_room, execute_clock, sequence_slots):
        monkeypatch.setattr(module, "scratch_base", lambda: base)
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead, alive = ended.pid, os.getpid()
    for pid in (dead, alive, 12345678):  # 12345678: another namespace's server, not running here
        for path in (cancellation.default_directory(pid), kv_room.default_directory(pid),
                     execute_clock.default_directory(pid), sequence_slots.default_directory(8, pid),
                     sequence_slots.default_directory(16, pid)):
            path.mkdir()
            (path / "flag").touch()
    run_dir = tmp_path / "run"
    assert launcher.remove_ended_servers_scratch(run_dir) == 0  # no run directory yet
    run_dir.mkdir()
    (run_dir / launcher.SERVER_PID_FILE).write_text(f"{alive}\n")
    assert launcher.remove_ended_servers_scratch(run_dir) == 0  # still running
    (run_dir / launcher.SERVER_PID_FILE).write_text(f"{dead}\n")
    assert launcher.remove_ended_servers_scratch(run_dir) == 5
    left = sorted(path.name for path in base.iterdir())
    assert not [name for name in left if name.endswith((f"-{dead}", f"-{dead}-8", f"-{dead}-16"))]
    assert len(left) == 10  # the running one's and the other namespace's
    assert not (run_dir / launcher.SERVER_PID_FILE).exists()
    assert launcher.remove_ended_servers_scratch(run_dir) == 0
