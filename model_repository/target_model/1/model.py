"""Triton Python-backend entry point for `target_model`: a thin adapter over specdec.triton.language_models.TargetModel."""

from specdec.triton.language_models import TargetModel


class TritonPythonModel(TargetModel):
    pass
