"""Triton Python-backend entry point for `preprocessing`: a thin adapter over specdec.triton_text.PreprocessingAdapter."""

from specdec.triton_text import PreprocessingAdapter


class TritonPythonModel(PreprocessingAdapter):
    pass
