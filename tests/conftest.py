import os

import pytest
import torch


def _has_cuda():
    # COMERA_TEST_CUDA_DEVICE=cpu runs the needs_cuda tests' own logic on the
    # CPU (see tests/test_cuda.py), to check them on a machine without a GPU
    return torch.cuda.is_available() or os.environ.get("COMERA_TEST_CUDA_DEVICE") == "cpu"


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
