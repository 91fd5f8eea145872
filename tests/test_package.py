"""The package's shape: ``import comera`` pulls in neither the application
(comera.pretrain) nor the optional extras, the wings import downward only with
no cycle (tools/check_imports.py), and the public names stay where they were."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_comera_loads_no_application_and_no_extras():
    code = ("import sys, comera\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('transformers', 'matplotlib', 'tokenizers', 'safetensors') "
            "or m.startswith('comera.pretrain'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_wings_have_no_import_cycle_and_point_downward():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_imports.py")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 cycles, 0 problems" in out.stdout


def test_checker_finds_a_cycle(tmp_path, monkeypatch):
    """The checker itself: a made-up two-module cycle is reported."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import check_imports
    finally:
        sys.path.pop(0)
    assert check_imports.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert check_imports.cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("name", ["TTLinear", "TTEmbedding", "RankAdaptive", "prune", "summary",
                                  "compression", "convert", "to_dense", "save", "load",
                                  "load_state_dict", "from_pretrained", "output_pool",
                                  "cuda_kernels", "ops", "__version__"])
def test_public_names(name):
    import comera
    assert getattr(comera, name) is not None
    assert callable(getattr(comera, name)) or name in ("ops", "__version__")


def test_function_names_win_over_subpackages():
    """``comera.convert`` is the function even though ``comera/convert/`` is a
    package (and likewise ``comera.prune``, ``comera.summary``)."""
    import comera
    import comera.convert.ties  # noqa: F401  (loading a submodule must not rebind the name)
    assert callable(comera.convert) and comera.convert.__module__ == "comera.convert.replace"
    assert comera.prune.__module__ == "comera.adapt.prune"
    assert comera.summary.__module__ == "comera.layers.summary"
