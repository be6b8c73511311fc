"""Triton Python-backend entry point for `speculative_decoding`: a thin adapter over specdec.triton_orchestrator.SpeculativeDecodingAdapter."""

from specdec.triton_orchestrator import SpeculativeDecodingAdapter


class TritonPythonModel(SpeculativeDecodingAdapter):
    pass
