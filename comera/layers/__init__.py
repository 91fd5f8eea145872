"""The TT layers: :class:`TTLinear`, :class:`TTEmbedding`, the tied output
head :class:`TiedTTLinear`, the shared layer helpers (:mod:`.base`), the TT
factorisation helpers (:mod:`.tt`) and model summaries (:mod:`.summary`).
Layers call the operators of :mod:`comera.ops` and nothing above them."""
from comera.layers.embedding import TTEmbedding
from comera.layers.linear import TTLinear
from comera.layers.summary import compression, summary
from comera.layers.tied import TiedTTLinear

__all__ = ["TTLinear", "TTEmbedding", "TiedTTLinear", "summary", "compression"]
