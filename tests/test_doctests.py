"""Every docstring example in the package runs and prints what it claims."""
import doctest
import importlib
import pkgutil

import pytest

import comera

# Not walked: the extension modules (comera._C, comera._C_cuda: no
# docstrings, and comera._C_cuda is imported only under a torch with CUDA,
# see comera/_cuda.py) and the parts left out before them.
SKIP = ("comera.pretrain", "comera.integrations.ddp", "comera.integrations.hf.trainer",
        "comera.integrations.hf.checkpoints", "comera.__main__", "comera._C")
MODULES = sorted(m.name for m in pkgutil.walk_packages(comera.__path__, "comera.")
                 if not m.name.startswith(SKIP))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
