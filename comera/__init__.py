"""comera: rank-adaptive tensor-train layers with C and CUDA kernels (CoMERA).

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
from comera import ops
from comera.embedding import TTEmbedding
from comera.linear import TTLinear
from comera.prune import prune
from comera.rank_adaptive import RankAdaptive
from comera.summary import compression, summary
from comera.convert import convert, to_dense
from comera.persistence import load, load_state_dict, save
from comera.output_pool import output_pool
from comera.hf_pretrained import from_pretrained  # imports transformers only when called

__version__ = "0.1.0"
__all__ = ["TTLinear", "TTEmbedding", "RankAdaptive", "prune", "summary", "compression",
           "load_state_dict", "ops"]
__all__ += ["convert", "to_dense", "save", "load", "from_pretrained", "cuda_kernels",
            "output_pool"]
