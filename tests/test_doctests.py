"""Every docstring example in the package runs and prints what it claims."""
import doctest
import importlib
import pkgutil

import pytest

import comera

MODULES = sorted(m.name for m in pkgutil.walk_packages(comera.__path__, "comera.")
                 if not m.name.startswith(("comera.pretrain", "comera.integrations", "comera.__main__")))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
