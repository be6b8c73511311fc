"""A text model's execute stamp (triton/execute_clock.py), as the launcher's watchdog reads it."""

import os

from specdec.triton import execute_clock


def test_an_execute_is_stamped_while_it_runs_and_cleared_after(tmp_path):
    now = [1000.0]
    clock = execute_clock.ExecuteClock("preprocessing_0_0", tmp_path, clock=lambda: now[0])
    other = execute_clock.ExecuteClock("postprocessing_0_0", tmp_path, clock=lambda: now[0])
    try:
        idle = {"preprocessing_0_0": (0.0, os.getpid()), "postprocessing_0_0": (0.0, os.getpid())}
        assert execute_clock.stamps(tmp_path) == idle  # both idle from the start
        with clock:
            assert execute_clock.stamps(tmp_path) == {**idle, "preprocessing_0_0": (1000.0, os.getpid())}
        assert execute_clock.stamps(tmp_path) == idle
        try:
            with other:
                raise ValueError("an execute that fails")
        except ValueError:
            pass
        assert execute_clock.stamps(tmp_path) == idle  # cleared however it ended
    finally:
        clock.close()
        other.close()


def test_unreadable_or_short_files_and_a_missing_directory_read_as_idle(tmp_path):
    (tmp_path / "broken_0_0").write_bytes(b"\x01\x02")
    (tmp_path / "a_directory").mkdir()
    assert execute_clock.stamps(tmp_path) == {}
    assert execute_clock.stamps(tmp_path / "absent") == {}


def test_a_new_stub_of_the_same_instance_starts_idle(tmp_path):
    (tmp_path / "preprocessing_0_0").write_bytes(execute_clock.STAMP.pack(5.0, 123))  # its dead predecessor's
    clock = execute_clock.ExecuteClock("preprocessing_0_0", tmp_path)
    clock.close()
    assert execute_clock.stamps(tmp_path) == {"preprocessing_0_0": (0.0, os.getpid())}
