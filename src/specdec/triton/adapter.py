"""The base of every Python-backend adapter: `initialize` validates the model's config before any request.

`triton_python_backend_utils` exists only inside a Python-backend stub, so it is imported here, at load,
and handed to the adapter as `self.pb`; everything below this layer never sees it.
"""

from __future__ import annotations

from specdec.triton.config import ModelParameters


class TritonAdapter:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.load(ModelParameters(args["model_config"]), args)

    def load(self, params: ModelParameters, args: dict) -> None:
        """Read and check the config parameters (a ConfigError names the bad one), load what the model needs."""
        raise NotImplementedError
