import os
import time

from specdec.triton.admission.cancellation import CancellationBoard


def test_flags_are_shared_through_the_directory(tmp_path):
    postprocessing, orchestrator = CancellationBoard(tmp_path), CancellationBoard(tmp_path)
    key = 0x7FFF_FFFF_FFFF_FFFF
    assert not orchestrator.is_cancelled(key)
    postprocessing.cancel(key)
    assert orchestrator.is_cancelled(key) and not orchestrator.is_cancelled(key - 1)
    orchestrator.clear(key)
    assert not orchestrator.is_cancelled(key)
    orchestrator.clear(key)  # clearing twice is harmless


def test_sweep_removes_only_stale_flags(tmp_path):
    board = CancellationBoard(tmp_path)
    board.cancel(1)
    board.cancel(2)
    old = time.time() - 3600
    os.utime(tmp_path / "1", (old, old))
    board.sweep(older_than_s=600)
    assert not board.is_cancelled(1) and board.is_cancelled(2)
