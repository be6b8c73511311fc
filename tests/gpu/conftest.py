import pytest
import torch


def pytest_collection_modifyitems(items):
    """Every test here needs CUDA: marked `gpu`, skipped where torch sees no GPU (CI stays CPU-only)."""
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)
