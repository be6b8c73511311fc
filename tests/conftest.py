"""Loaded before every test directory's conftest and module."""

import os

import torch

# Without a GPU, Triton kernels (engine/paged_attention.py) run in Triton's interpreter. Triton chooses when
# triton.language is first imported, which transformers does on import: so here, before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
