"""Triton Python-backend entry point for `target_model`: a thin adapter over specdec.triton_lm.TargetModel."""

from specdec.triton_lm import TargetModel


class TritonPythonModel(TargetModel):
    pass
