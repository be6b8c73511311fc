"""Triton Python-backend entry point for `preprocessing`: a thin adapter over specdec.triton.text_models.PreprocessingAdapter."""

from specdec.triton.text_models import PreprocessingAdapter


class TritonPythonModel(PreprocessingAdapter):
    pass
