"""An output projection that shares its weight with a TT embedding.

Language models often tie the output layer to the input embedding
(``lm_head.weight is embed.weight``).  When :func:`comera.convert` turns the
embedding into a :class:`comera.TTEmbedding`, the output layer becomes a
:class:`TiedTTLinear` that reads the embedding's reconstructed table on every
call, so the two stay one set of parameters (the TT cores) while training.
"""
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from comera.ops.dense import ttm_table

_HALF = (torch.bfloat16, torch.float16)


def embedding_table(embedding: nn.Module) -> torch.Tensor:
    """The reconstructed (differentiable) table of a TT embedding: its
    ``.weight`` when it defines one, else the TTM product of its cores."""
    w = getattr(type(embedding), "weight", None)
    if isinstance(w, property):
        return embedding.weight
    return ttm_table(list(embedding.cores), list(embedding.gates), embedding.num_embeddings,
                     embedding.embedding_dim)


class TiedTTLinear(nn.Module):
    r"""``y = x E^T + b`` where ``E`` is the table of a TT embedding (weight tying).

    The embedding is referenced, not registered as a child, so its cores appear
    once in ``parameters()`` and ``state_dict()`` (under the embedding's own
    name); the bias is this module's own parameter (possibly shared with
    another module, as in BERT's ``cls.predictions.bias``).  ``to_dense()``
    is an ``nn.Linear`` with its own copy of the table; :func:`comera.to_dense`
    instead re-ties it to the densified embedding.

    Example:
        >>> import torch, comera
        >>> from comera.layers.tied import TiedTTLinear
        >>> emb = comera.TTEmbedding(100, 16, rank=4)
        >>> head = TiedTTLinear(emb, bias=torch.nn.Parameter(torch.zeros(100)))
        >>> head(torch.randn(2, 16)).shape
        torch.Size([2, 100])
        >>> torch.equal(head.weight, emb.weight)
        True
    """

    def __init__(self, embedding: nn.Module, bias: Optional[torch.Tensor] = None):
        super().__init__()
        for attr in ("cores", "gates", "num_embeddings", "embedding_dim"):
            if not hasattr(embedding, attr):
                raise TypeError(f"TiedTTLinear: embedding must be a TT embedding (with .{attr}), "
                                f"got {type(embedding).__name__}")
        # a tuple hides the module from nn.Module's registration (no second copy of the cores)
        self._tied_to = (embedding,)
        self.in_features = int(embedding.embedding_dim)
        if bias is not None:
            if not isinstance(bias, nn.Parameter):
                bias = nn.Parameter(bias.detach().clone())
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"TiedTTLinear: bias must have shape ({self.out_features},), got "
                                 f"{tuple(bias.shape)}")
        self.bias = bias

    @property
    def embedding(self) -> nn.Module:
        """The TT embedding whose table is this layer's weight."""
        return self._tied_to[0]

    @property
    def out_features(self) -> int:
        """The embedding's row count: it follows a resize of the embedding
        (whose caller resizes the bias too)."""
        return int(self.embedding.num_embeddings)

    @property
    def weight(self) -> torch.Tensor:
        """The tied weight, ``(out_features, in_features)`` = the embedding's table."""
        return embedding_table(self.embedding)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input  # nn.Linear's argument name, so m(input=x) works
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError("TiedTTLinear expects a floating-point Tensor input, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"TiedTTLinear input must have shape (*, in_features={self.in_features}), "
                             f"got {tuple(x.shape)}")
        w = self.weight
        b = self.bias
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            if x.dtype in _HALF:  # like TTLinear: half input, float32 compute, half output
                return F.linear(x.to(w.dtype), w, b).to(x.dtype)
            raise TypeError(f"TiedTTLinear input dtype {x.dtype} does not match the weight's {w.dtype}")
        return F.linear(x, w, b)

    def to_dense(self) -> nn.Linear:
        """An untied ``nn.Linear`` holding a copy of the current table."""
        w = self.weight
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tied to {type(self.embedding).__name__}")
