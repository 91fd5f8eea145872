"""transformers' generic model tests over converted models (README.md): the
markers transformers' own conftest registers for them, and collection only where
transformers' test dependencies are installed (the `train` and `test` extras)."""
import importlib.util
import os

collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in (
    "transformers", "parameterized", "safetensors", "accelerate")) else ["*.py"]

_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
            "torch_compile_test")


def pytest_configure(config):
    for name in _MARKERS:
        config.addinivalue_line("markers", f"{name}: a marker of transformers' model tests")


def pytest_collection_modifyitems(config, items):
    """These tests run last: their thousands of model builds leave the
    process heap fragmented, and tests that count page faults
    (tests/ops/test_output_pool.py) measure the process, not only themselves."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    ours = [i for i in items if str(i.path).startswith(here)]
    if ours:
        rest = [i for i in items if not str(i.path).startswith(here)]
        items[:] = rest + ours


if not collect_ignore_glob:
    import pytest
    import torch

    @pytest.fixture(autouse=True)
    def _one_thread():
        """The testers' models are tiny (hidden size 32): one thread runs them
        faster than a pool whose start-up costs more than each operation."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)
