"""Clients' torch profiles of the models' executions (triton/live_profile.py): a start's settings validated
naming the field; each execute run on the profile's own thread while one runs and on the caller's otherwise;
the trace holding exactly the profiled executions (start_step skipped, num_steps counted), written on a stop
that comes with no execute after it, on a new start, and at unload; a trace Kineto wrote broken repaired."""

import gzip
import json
import os
import threading
import time

import pytest
import torch

from specdec.triton import live_profile


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


def labels(path: str) -> list[str]:
    return sorted(e["name"] for e in events(path) if e.get("cat") == "user_annotation")


class Model:
    """A model instance's side: a tracer over a control file, an execute of one matrix product."""

    def __init__(self, tmp_path, name: str = "target_model"):
        self.dir, self.control, self.log = tmp_path, str(tmp_path / "control"), []
        self.tracer = live_profile.Tracer(name, self.control, self.log.append)
        self.x = torch.randn(32, 32)

    def execute(self, fail: bool = False) -> int:
        def work():
            if fail:
                raise RuntimeError("planted")
            (self.x @ self.x).sum()
            return threading.get_ident()
        return self.tracer.run(work)

    def start(self, **fields) -> live_profile.Command:
        command = live_profile.start_command(fields, str(self.dir), live_profile.new_profile_id())
        live_profile.send(self.control, command)
        return command

    def stop(self, started: live_profile.Command) -> str:
        live_profile.send(self.control, live_profile.Command("stop", started.profile_id, started.output_dir))
        wait_for(lambda: live_profile.traces(started) and not live_profile.unfinished(started))
        (path,) = live_profile.traces(started)
        return path


def products(path: str) -> int:
    return sum(1 for e in events(path) if e.get("name") == "aten::mm")


def test_a_profile_runs_each_execute_on_its_own_thread_and_traces_exactly_those(tmp_path):
    model = Model(tmp_path)
    here = threading.get_ident()
    assert model.execute() == here and not list(tmp_path.glob("*.gz"))  # no profile: run by the caller
    started = model.start()
    threads = {model.execute() for _ in range(4)}
    assert here not in threads and len(threads) == 1
    assert live_profile.unfinished(started) == [started.trace_name("target_model", os.getpid())]
    path = model.stop(started)
    assert path.endswith(".trace.json.gz") and started.profile_id in path
    assert labels(path) == [f"target_model execute {i}" for i in range(4)] and products(path) == 4
    assert model.execute() == here  # ended: the caller's again
    assert not list(tmp_path.glob(".*.tracing"))


def test_start_step_runs_unprofiled_and_num_steps_ends_the_profile_by_itself(tmp_path):
    model = Model(tmp_path)
    started = model.start(start_step=2, num_steps=3)
    for _ in range(8):
        model.execute()
    wait_for(lambda: live_profile.traces(started) and not live_profile.unfinished(started))
    (path,) = live_profile.traces(started)
    assert labels(path) == [f"target_model execute {i}" for i in range(3)] and products(path) == 3


def test_a_stop_is_seen_without_an_execute_after_it(tmp_path):
    model = Model(tmp_path)
    started = model.start()
    model.execute()
    began = time.monotonic()
    path = model.stop(started)  # nothing executes from here on: the idle profile looks by itself
    assert time.monotonic() - began < 5 and products(path) == 1


def test_an_executes_error_reaches_its_caller_and_the_profile_goes_on(tmp_path):
    model = Model(tmp_path)
    started = model.start()
    with pytest.raises(RuntimeError, match="planted"):
        model.execute(fail=True)
    model.execute()
    assert products(model.stop(started)) == 1


def test_a_new_start_ends_the_running_profile_and_unload_writes_the_last(tmp_path):
    model = Model(tmp_path)
    first = model.start()
    model.execute()
    time.sleep(0.002)  # another profile id (the millisecond)
    second = model.start(activities=["CPU", "MEM"], with_stack=False, record_shapes=True)
    assert second.profile_id != first.profile_id
    model.execute()
    model.execute()
    wait_for(lambda: live_profile.traces(first) and not live_profile.unfinished(first))
    assert products(live_profile.traces(first)[0]) == 1
    model.tracer.close()  # the model unloads mid-profile
    (path,) = live_profile.traces(second)
    assert products(path) == 2 and not live_profile.unfinished(second)
    assert any(e.get("name") == "[memory]" for e in events(path))  # MEM: allocations recorded


def test_a_command_from_before_the_instance_started_asks_nothing(tmp_path):
    early = Model(tmp_path)
    early.start()
    late = Model(tmp_path, "draft_model")
    assert late.execute() == threading.get_ident()


@pytest.mark.parametrize("fields, field", [
    ({"num_steps": 0}, "num_steps"), ({"num_steps": "3"}, "num_steps"), ({"start_step": -1}, "start_step"),
    ({"start_step": True}, "start_step"), ({"with_stack": "yes"}, "with_stack"),
    ({"record_shapes": 1}, "record_shapes"),
    ({"activities": ["CPU", "RPD"]}, "activities"), ({"activities": "CPU"}, "activities"),
    ({"output_dir": "relative/dir"}, "output_dir"), ({"output_dir": 3}, "output_dir"),
])
def test_a_bad_setting_is_refused_naming_it(fields, field):
    with pytest.raises(live_profile.SettingError) as refused:
        live_profile.start_command(fields, "/tmp/traces", "id")
    assert refused.value.field == field and f"'{field}'" in str(refused.value)


def test_a_starts_settings_and_defaults():
    default = live_profile.start_command({}, "/srv/traces", "id")
    assert default == live_profile.Command("start", "id", "/srv/traces", ("CPU", "GPU"), 0, None, True, False)
    given = live_profile.start_command({"output_dir": "/a/b/../c", "activities": ["GPU", "GPU", "CPU"],
                                        "start_step": 3, "num_steps": 5, "with_stack": False, "record_shapes": True,
                                        "merge_profiles": True, "profile_by_stage": False}, "/srv", "id")
    assert given == live_profile.Command("start", "id", "/a/c", ("GPU", "CPU"), 3, 5, False, True)
    assert live_profile.Command.decode(given.encode()) == given
    assert live_profile.Command.decode("{not json") is None and live_profile.Command.decode('{"a": 1}') is None
    with pytest.raises(live_profile.SettingError, match="output_dir"):
        live_profile.start_command({}, "", "id")  # no directory given and none configured


def test_the_directory_is_ours_else_vllms_else_sglangs():
    env = {"SGLANG_TORCH_PROFILER_DIR": "/s", "VLLM_TORCH_PROFILER_DIR": "/v"}
    assert live_profile.directory_from_env(env) == "/v"
    assert live_profile.directory_from_env({**env, live_profile.DIR_ENV: "/ours"}) == "/ours"
    assert live_profile.directory_from_env({"SGLANG_TORCH_PROFILER_DIR": "/s"}) == "/s"
    assert live_profile.directory_from_env({}) == ""
    assert live_profile.control_file(8000) != live_profile.control_file(18000)
    assert live_profile.new_profile_id(0.5) == "19700101-000000-500"


def test_a_trace_kineto_wrote_broken_is_repaired():
    broken = ('{\n  "traceEvents": [\n  {\n    "ph": "X", "cat": "python_function",\n'
              '    "name": "torch/x.py(0): "activities"",\n    "args": {\n      "Python id": 3\n    }\n  },\n'
              '  {\n    "name": "frame \\\\ ').encode() + b"\xff\xfe" + b'",\n    "ts": 1\n  }\n]}'
    with pytest.raises(ValueError):
        json.loads(broken.decode("utf-8", errors="replace"))
    fixed = json.loads(live_profile.repaired(broken))["traceEvents"]
    assert fixed[0] == {"ph": "X", "cat": "python_function", "name": 'torch/x.py(0): "activities"',
                        "args": {"Python id": 3}}
    assert fixed[1] == {"name": "frame \\ \ufffd\ufffd", "ts": 1}
    whole = '{"traceEvents": [{"name": "a \\"quoted\\" name"}]}'
    assert live_profile.repaired(whole.encode()) == whole  # valid already: as written


def test_the_summary_counts_executions_and_operators_by_self_time(tmp_path):
    model = Model(tmp_path)
    started = model.start()
    for _ in range(3):
        model.execute()
    text = live_profile.summary(model.stop(started))
    assert "3 executions" in text and "| `aten::mm` | 3 |" in text and "Python's functions" in text
    events_ = [{"ph": "X", "cat": "user_annotation", "name": "m execute 0", "ts": 0, "dur": 20, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 1, "dur": 10, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 2, "dur": 4, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 12, "dur": 2, "tid": 1},
               {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 3, "dur": 5, "tid": 7},
               {"ph": "X", "cat": "python_function", "name": "<built-in method view of Tensor object at 0x7f1>",
                "ts": 15, "dur": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "<built-in method view of Tensor object at 0x7f2>",
                "ts": 16, "dur": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "threading.py(331): wait", "ts": 0, "dur": 20, "tid": 2}]
    path = tmp_path / "made.trace.json.gz"
    with gzip.open(path, "wt") as out:
        json.dump({"traceEvents": events_}, out)
    text = live_profile.summary(str(path))
    # outer's own time: 10 less the 4 of the inner call within it; the later inner is not inside it
    assert "| `outer` | 1 | 0.01 | 30.0% |" in text and "| `inner` | 2 | 0.01 | 30.0% |" in text
    assert "| `gemm` | 1 | 0.01 | 25.0% |" in text and "torch's CPU operators 60.0%" in text
    # one row per C function, whatever it was called on; another thread's wait is no execution's time
    assert "| `view (C)` | 2 | 0.00 | 10.0% |" in text and "threading" not in text
