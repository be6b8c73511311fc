"""Loaded before every test directory's conftest and module."""

import os
import tempfile

import torch

# Without a GPU, Triton kernels (engine/paged_attention.py) run in Triton's interpreter. Triton chooses when
# triton.language is first imported, which transformers does on import: so here, before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The linear kernels' timings (engine/onednn_linear.py) are kept on disk between loads: a run of the suite
# keeps its own, so it times as a new machine would and never reads what an earlier run (or code) timed.
# Its servers share them; unit tests each get a directory of their own (tests/unit/conftest.py).
from specdec.engine.onednn_linear import TIMES_DIR_ENV  # noqa: E402 (after TRITON_INTERPRET)

os.environ[TIMES_DIR_ENV] = tempfile.mkdtemp(prefix="specdec-kernel-times-")
