"""The base of every Python-backend adapter: `initialize` validates the model's config before any request.

`triton_python_backend_utils` exists only inside a Python-backend stub, so it is imported here, at load,
and handed to the adapter as `self.pb`; everything below this layer never sees it.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys

from specdec.triton.config import ModelParameters


STUB_MODULE = "c_python_backend_utils"  # the Python backend's stub embeds it; no other process has it


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report_crashes() -> None:
    """A fatal signal in this process (a segfault) prints every thread's Python stack to stderr, which
    tritonserver's log carries: the stub's embedded interpreter ignores PYTHONFAULTHANDLER (it reads no
    environment variable), so without this a crashed stub leaves nothing but the watchdog's line."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr, or one without a descriptor
        pass


class TritonAdapter:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        report_crashes()
        self.pb = pb_utils
        self.load(ModelParameters(args["model_config"]), args)

    def load(self, params: ModelParameters, args: dict) -> None:
        """Read and check the config parameters (a ConfigError names the bad one), load what the model needs."""
        raise NotImplementedError

    def finalize(self) -> None:
        """The model is unloaded: all the stub has left to do is exit. Its interpreter's teardown (every
        module of torch and transformers) would take about a second more per stub, at every unload; the
        process's exit frees the same. Registered last, this runs first of the exit handlers, after the
        stub has answered the unload and its threads have been joined. Only in a stub (its embedded
        module is loaded): elsewhere, a test's process, it would replace the exit code."""
        if STUB_MODULE in sys.modules:
            atexit.register(_exit_now)
