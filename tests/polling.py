"""Waiting for a condition in tests: poll it until it holds (its value returned) or fail the test, naming it."""

import time

import pytest


def wait_for(condition, timeout_s: float, what: str, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}")
