"""Triton Python-backend entry point for `postprocessing`: a thin adapter over specdec.triton.text_models.PostprocessingAdapter."""

from specdec.triton.text_models import PostprocessingAdapter


class TritonPythonModel(PostprocessingAdapter):
    pass
