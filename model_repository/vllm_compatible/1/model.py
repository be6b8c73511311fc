"""Triton Python-backend entry point for `vllm_compatible`: a thin adapter over specdec.triton.vllm_compatible.VllmCompatibleAdapter."""

from specdec.triton.vllm_compatible import VllmCompatibleAdapter


class TritonPythonModel(VllmCompatibleAdapter):
    pass
