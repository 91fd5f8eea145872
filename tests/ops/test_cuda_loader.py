"""comera/_cuda.py: when comera imports its CUDA kernels (comera._C_cuda).

These run under any torch: the cases a CPU machine cannot reach for real (a
torch with CUDA, a module that fails to load) are staged by replacing what
the loader consults.  tools/xver_test.sh loads the real module from the
wheel under the CUDA build of torch.
"""
import importlib.machinery
import sys
import warnings

import pytest
import torch

import comera
from comera import _cuda


@pytest.fixture
def restore_status():
    saved = _cuda._STATUS
    yield
    _cuda._STATUS = saved


def test_cpu_torch_never_imports_the_cuda_module(restore_status, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    calls = []
    monkeypatch.setattr(_cuda.importlib, "import_module", lambda name: calls.append(name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = _cuda.load()
    assert calls == []
    assert status.startswith("not loaded:") and torch.__version__ in status
    assert comera.cuda_kernels() == status


def test_status_at_import_matches_this_torch():
    status = comera.cuda_kernels()
    if torch.version.cuda is None:
        assert status.startswith("not loaded:")
        assert "comera._C_cuda" not in sys.modules
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("comera::tt_linear", "CUDA")
    elif status.startswith("loaded:"):
        assert "comera._C_cuda" in sys.modules
        assert torch._C._dispatch_has_kernel_for_dispatch_key("comera::tt_linear", "CUDA")
    else:
        assert status.startswith(("not built:", "failed:")), status


def test_cuda_torch_without_a_cuda_module(restore_status, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_cuda.importlib.util, "find_spec", lambda name: None)
    status = _cuda.load()
    assert status.startswith("not built:"), status


def test_a_module_that_fails_to_load_is_a_warning(restore_status, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    spec = importlib.machinery.ModuleSpec("comera._C_cuda", None)
    monkeypatch.setattr(_cuda.importlib.util, "find_spec", lambda name: spec)

    def fail(name):
        assert name == "comera._C_cuda"
        raise ImportError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(_cuda.importlib, "import_module", fail)
    with pytest.warns(RuntimeWarning, match="CUDA kernels are unavailable.*libcudart.so.13"):
        status = _cuda.load()
    assert status.startswith("failed:") and "libcudart.so.13" in status


def test_a_loaded_module_reports_its_cuda_version(restore_status, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    spec = importlib.machinery.ModuleSpec("comera._C_cuda", None)
    monkeypatch.setattr(_cuda.importlib.util, "find_spec", lambda name: spec)

    class Module:
        cuda_runtime_version = 12080  # CUDART_VERSION of CUDA 12.8

    monkeypatch.setattr(_cuda.importlib, "import_module", lambda name: Module)
    status = _cuda.load()
    assert status.startswith("loaded:") and "built with CUDA 12.8" in status, status
