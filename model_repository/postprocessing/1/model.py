"""Triton Python-backend entry point for `postprocessing`: a thin adapter over specdec.triton_text.PostprocessingAdapter."""

from specdec.triton_text import PostprocessingAdapter


class TritonPythonModel(PostprocessingAdapter):
    pass
