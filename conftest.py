import os

import pytest
import torch


def _has_cuda():
    # COMERA_TEST_CUDA_DEVICE=cpu runs the needs_cuda tests' own logic on the
    # CPU (see tests/ops/test_cuda.py), to check them on a machine without a GPU
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


@pytest.fixture(autouse=True)
def _tf32_off(request):
    """The needs_cuda tests compare float32 results at tolerances near 1e-5.
    torch's cuBLAS handle (which the TTLinear CUDA kernels use) runs float32
    GEMMs on TF32 tensor cores when torch.backends.cuda.matmul.allow_tf32 is
    True, with a 10-bit mantissa (errors near 1e-3): so those tests pin TF32
    off, whatever the process set before, and restore it afterwards."""
    if "needs_cuda" not in request.keywords:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
