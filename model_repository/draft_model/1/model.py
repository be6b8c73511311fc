"""Triton Python-backend entry point for `draft_model`: a thin adapter over specdec.triton_lm.DraftModel."""

from specdec.triton_lm import DraftModel


class TritonPythonModel(DraftModel):
    pass
