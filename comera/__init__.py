"""comera: rank-adaptive tensor-train layers with C and CUDA kernels (CoMERA).

Quick start:
    >>> import torch, comera
    >>> layer = comera.TTLinear(768, 3072, rank=16)
    >>> layer(torch.randn(4, 768)).shape
    torch.Size([4, 3072])
"""
import torch  # noqa: F401  (loads libc10/libtorch before the extension needs them)
from comera import _C  # noqa: F401  (loads and registers the operators)
from comera import ops
from comera.linear import TTLinear

__version__ = "0.1.0"
__all__ = ["TTLinear", "ops"]
