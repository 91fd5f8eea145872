"""Loads comera's CUDA kernels (the extension module comera._C_cuda).

comera._C holds every operator schema and the CPU kernels; the CUDA kernels
are a second module, built where nvcc was found (a wheel carries them for
sm_80, sm_90 and sm_100).  It links libcudart and libcublas, which torch's
CUDA builds load on `import torch`, so it is imported only under a torch
with CUDA (torch.version.cuda set), never under a CPU-only torch.  A module
that fails to load (e.g. built for another CUDA major version than the
running torch's) is a warning, not an error: the CPU kernels still work and
a CUDA tensor then raises torch's NotImplementedError for its device.
"""
import importlib
import importlib.util
import warnings

import torch

_STATUS = "not loaded yet"


def load():
    """Imports comera._C_cuda where it applies; returns cuda_kernels()."""
    global _STATUS
    if torch.version.cuda is None:
        _STATUS = f"not loaded: torch {torch.__version__} was built without CUDA"
    elif importlib.util.find_spec("comera._C_cuda") is None:
        _STATUS = "not built: this comera has no CUDA module (built without nvcc)"
    else:
        try:
            module = importlib.import_module("comera._C_cuda")
        except ImportError as e:
            _STATUS = f"failed: comera._C_cuda did not load ({e})"
            warnings.warn(f"comera: the CUDA kernels are unavailable under torch {torch.__version__} "
                          f"(CUDA {torch.version.cuda}): {e}", RuntimeWarning, stacklevel=2)
        else:
            v = module.cuda_runtime_version
            _STATUS = (f"loaded: comera._C_cuda (built with CUDA {v // 1000}.{v % 1000 // 10}) "
                       f"under torch {torch.__version__} (CUDA {torch.version.cuda})")
    return _STATUS


def cuda_kernels():
    """Whether this process has comera's CUDA kernels, in words.

    The text starts with "loaded:", "not loaded:" (torch has no CUDA),
    "not built:" (this comera was built without nvcc) or "failed:" (the
    module did not load; the reason follows).  Seeing a GPU is not needed:
    "loaded" means the kernels are registered with torch's dispatcher.

    >>> import comera
    >>> comera.cuda_kernels().split(":")[0] in ("loaded", "not loaded", "not built", "failed")
    True
    """
    return _STATUS
