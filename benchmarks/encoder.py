"""A plain PyTorch transformer encoder classifier, the model of the CoMERA
paper's MNLI experiment: word + position (+ segment) embeddings, N pre-norm
encoder layers (multi-head attention with separate q/k/v/o nn.Linear, then a
GELU FFN), and a classifier head on the first token.

Every linear inside the encoder is an nn.Linear and the word embedding is an
nn.Embedding, so turning the model into a TT model is a module swap
(`to_comera`, which calls comera.convert); the classifier head stays dense.

Example:
    >>> import torch
    >>> cfg = PRESETS["tiny"]
    >>> model = EncoderClassifier(cfg)
    >>> ids = torch.randint(0, cfg.vocab, (2, cfg.seq))
    >>> model(ids).shape
    torch.Size([2, 2])
"""
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import comera


@dataclass(frozen=True)
class EncoderConfig:
    vocab: int
    hidden: int
    ffn: int
    heads: int
    layers: int
    seq: int
    classes: int
    dropout: float = 0.0
    pool: str = "cls"  # "cls": the first token; "mean": the mean over non-padding tokens

    def as_dict(self):
        return asdict(self)


PRESETS = {
    # The paper's six-encoder transformer (MNLI: 3 classes).
    "paper": EncoderConfig(vocab=30522, hidden=768, ffn=3072, heads=12, layers=6, seq=128, classes=3),
    # The CPU preset of the accuracy experiment (bench_accuracy.py).
    "small": EncoderConfig(vocab=8192, hidden=128, ffn=512, heads=4, layers=2, seq=96, classes=2,
                           dropout=0.1),
    # For smoke tests.
    "tiny": EncoderConfig(vocab=512, hidden=32, ffn=64, heads=2, layers=2, seq=16, classes=2),
}


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ffn1, self.ffn2 = nn.Linear(h, cfg.ffn), nn.Linear(cfg.ffn, h)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, key_padding=None):
        B, L, H = x.shape
        z = self.norm1(x)
        split = lambda t: t.reshape(B, L, self.heads, H // self.heads).transpose(1, 2)
        mask = None if key_padding is None else ~key_padding[:, None, None, :]
        a = F.scaled_dot_product_attention(split(self.q(z)), split(self.k(z)), split(self.v(z)),
                                           attn_mask=mask)
        x = x + self.drop(self.o(a.transpose(1, 2).reshape(B, L, H)))
        return x + self.drop(self.ffn2(F.gelu(self.ffn1(self.norm2(x)))))


class EncoderClassifier(nn.Module):
    """Embeddings, `cfg.layers` encoder layers, final LayerNorm and a linear
    classifier on the first token.  `forward(ids, segments=None,
    key_padding=None)`: key_padding is True where a position is padding."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position = nn.Embedding(cfg.seq, cfg.hidden)
        self.segment = nn.Embedding(2, cfg.hidden)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, ids, segments=None, key_padding=None):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(pos)
        if segments is not None:
            x = x + self.segment(segments)
        x = self.drop(x)
        for layer in self.layers:
            x = layer(x, key_padding)
        x = self.norm(x)
        if self.cfg.pool == "cls":
            return self.head(x[:, 0])
        keep = torch.ones_like(ids, dtype=x.dtype) if key_padding is None else (~key_padding).to(x.dtype)
        return self.head((x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1.0))


class DualEncoderClassifier(nn.Module):
    """A siamese (bi-encoder) pair classifier, as the CodeSearchNet baselines
    for code search: one shared encoder (word + position embeddings,
    `cfg.layers` encoder layers, final LayerNorm, mean over non-padding
    tokens) turns the query and the document into vectors u and v, and a
    small dense head classifies [u, v, |u - v|, u * v].  `embed(ids)` gives
    the pooled vectors (for a contrastive loss); `forward(query, doc)` the
    logits.  The attribute names match EncoderClassifier's, so `to_comera`
    converts the same encoder linears.

    Example:
        >>> import torch
        >>> cfg = PRESETS["tiny"]
        >>> model = DualEncoderClassifier(cfg)
        >>> q, d = torch.randint(1, cfg.vocab, (3, 5)), torch.randint(1, cfg.vocab, (3, cfg.seq))
        >>> model(q, d).shape
        torch.Size([3, 2])
    """

    def __init__(self, cfg: EncoderConfig, pad_id: int = 0):
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        self.word = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position = nn.Embedding(cfg.seq, cfg.hidden)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Sequential(nn.Linear(4 * cfg.hidden, cfg.hidden), nn.GELU(),
                                  nn.Linear(cfg.hidden, cfg.classes))
        # inverse temperature of the contrastive scores (learned, as in CLIP)
        self.logit_scale = nn.Parameter(torch.tensor(10.0))
        self.drop = nn.Dropout(cfg.dropout)

    def embed(self, ids):
        if ids.shape[1] > self.cfg.seq:
            raise ValueError(f"ids has {ids.shape[1]} positions; expected at most cfg.seq={self.cfg.seq}")
        padding = ids == self.pad_id
        x = self.drop(self.word(ids) + self.position(torch.arange(ids.shape[1], device=ids.device)))
        for layer in self.layers:
            x = layer(x, padding)
        x = self.norm(x)
        keep = (~padding).to(x.dtype)[..., None]
        return (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)

    def classify(self, u, v):
        return self.head(torch.cat([u, v, (u - v).abs(), u * v], -1))

    def forward(self, query, doc):
        return self.classify(self.embed(query), self.embed(doc))


def encoder_linear_names(model: EncoderClassifier):
    """Qualified names of the encoder's linears (what comera converts)."""
    return [f"layers.{i}.{n}" for i in range(len(model.layers))
            for n in ("q", "k", "v", "o", "ffn1", "ffn2")]


def to_comera(model: EncoderClassifier, rank: int, *, embedding: bool = True, init: str = "random"):
    """comera.convert on the encoder: every encoder nn.Linear (and the word
    embedding when `embedding`) becomes a TT layer of `rank`, in place; the
    position/segment embeddings and the classifier head stay dense.  Returns
    the model.  Every matched layer is converted, even where rank `rank` does
    not compress it (small presets), as the paper converts them all."""
    include = ["layers.*"] + (["word"] if embedding else [])
    return comera.convert(model, rank=rank, include=include, embeddings=embedding, init=init,
                          min_compression=1e-9)


def build_model(cfg: EncoderConfig, method: str, rank: int = 30, seed: int = 0,
                embedding: bool = True, arch: str = "cross"):
    """The dense model (`method` "dense") or its comera version ("comera"; the
    word embedding too when `embedding`); `arch` "cross" is the
    EncoderClassifier over [CLS] a [SEP] b, "dual" the DualEncoderClassifier."""
    torch.manual_seed(seed)
    if arch not in ("cross", "dual"):
        raise ValueError(f"arch must be 'cross' or 'dual', got {arch!r}")
    model = EncoderClassifier(cfg) if arch == "cross" else DualEncoderClassifier(cfg)
    if method == "comera":
        to_comera(model, rank, embedding=embedding)
    elif method != "dense":
        raise ValueError(f"method must be 'dense' or 'comera', got {method!r}")
    return model
