"""Triton Python-backend entry point for `speculative_decoding`: a thin adapter over specdec.triton.orchestrator.SpeculativeDecodingAdapter."""

from specdec.triton.orchestrator import SpeculativeDecodingAdapter


class TritonPythonModel(SpeculativeDecodingAdapter):
    pass
