"""Triton Python-backend entry point for `draft_model`: a thin adapter over specdec.triton.language_models.DraftModel."""

from specdec.triton.language_models import DraftModel


class TritonPythonModel(DraftModel):
    pass
