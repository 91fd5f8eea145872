"""comera: rank-adaptive tensor-train layers with C and CUDA kernels (CoMERA).

The package is built in wings that import downward only:
``ops`` (operators) <- ``layers`` <- ``adapt``, ``convert`` <- ``integrations``;
``pretrain`` is the application on top and is never imported from here.

Quick start:
    >>> import torch, comera
    >>> layer = comera.TTLinear(768, 3072, rank=16)
    >>> layer(torch.randn(4, 768)).shape
    torch.Size([4, 3072])
"""
import torch  # noqa: F401  (loads libtorch, which _C links against)

from comera import _C  # noqa: F401  (loads and registers the operators)
from comera._cuda import cuda_kernels, load as _load_cuda

_load_cuda()  # the CUDA kernels (comera._C_cuda), only under a torch with CUDA
from comera import ops  # noqa: E402
from comera._version import __version__  # noqa: E402
from comera.adapt import RankAdaptive, prune  # noqa: E402
from comera.convert import convert, to_dense  # noqa: E402
from comera.integrations.hf import from_pretrained  # noqa: E402  (imports transformers only when called)
from comera.layers import TTEmbedding, TTLinear, compression, summary  # noqa: E402
from comera.ops.output_pool import output_pool  # noqa: E402
from comera.storage import load, load_state_dict, save  # noqa: E402

__all__ = ["TTLinear", "TTEmbedding", "RankAdaptive", "prune", "summary", "compression",
           "load_state_dict", "ops"]
__all__ += ["convert", "to_dense", "save", "load", "from_pretrained", "cuda_kernels",
            "output_pool"]
