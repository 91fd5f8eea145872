"""comera.convert / comera.to_dense: swap the nn.Linear and nn.Embedding layers
of an existing model for TT layers (and back), in place.

Selection is by fnmatch-style glob patterns on qualified module names (the
names of ``model.named_modules()``; ``*`` also matches dots).  Weight ties
(an LM head sharing the word embedding's weight) are detected by parameter
identity and are never broken silently: see ``tie`` in :func:`convert`.
"""
import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from comera.layers.embedding import TTEmbedding
from comera.layers.linear import TTLinear
from comera.layers.tied import TiedTTLinear
from comera.convert.ties import group_source, resolve_ties

logger = logging.getLogger("comera")

Patterns = Union[None, str, Sequence[str]]
RankSpec = Union[int, Sequence[int], Mapping[str, Union[int, Sequence[int]]]]
_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_TIES = ("keep", "untie", "skip")

# Model-family fix-ups run after a conversion (model, tied_changed) and after
# to_dense (model): integrations register theirs, so this wing imports none.
_after_convert: List[Callable[[nn.Module, bool], None]] = []
_after_to_dense: List[Callable[[nn.Module], None]] = []


def register_model_hooks(after_convert: Callable[[nn.Module, bool], None],
                         after_to_dense: Callable[[nn.Module], None]) -> None:
    """Adds a fix-up that :func:`convert` runs on a converted model (with
    whether a weight tie changed) and one that :func:`to_dense` runs on a
    densified model; each must leave other model families alone."""
    if after_convert not in _after_convert:
        _after_convert.append(after_convert)
    if after_to_dense not in _after_to_dense:
        _after_to_dense.append(after_to_dense)


@dataclass
class _Layer:
    """One nn.Linear / nn.Embedding found in the model and what happens to it."""
    name: str
    module: nn.Module
    kind: str                                   # "linear" | "embedding"
    places: List[Tuple[Optional[nn.Module], str]] = field(default_factory=list)
    reason: Optional[str] = None                # why it stays dense (None: convert)
    rank: Optional[RankSpec] = None
    new: Optional[nn.Module] = None
    tt_params: int = 0
    tied_to: Optional[str] = None               # name of the layer whose TT weight it shares

    @property
    def dense_params(self) -> int:
        return self.module.weight.numel()

    @property
    def shape(self) -> str:
        m = self.module
        if self.kind == "linear":
            return f"{m.in_features}->{m.out_features}"
        return f"{m.num_embeddings}x{m.embedding_dim}"


# ------------------------------------------------------------------ arguments
def _patterns(value: Patterns, name: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"convert: {name} must be None, a glob string or a list of glob strings, got {value!r}")


def _check_rank(rank) -> None:
    def ok(r):
        if isinstance(r, bool):
            return False
        if isinstance(r, int):
            return r >= 1
        return (isinstance(r, (list, tuple)) and len(r) > 0
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in r))

    if isinstance(rank, Mapping):
        for key, r in rank.items():
            if not isinstance(key, str) or not ok(r):
                raise ValueError("convert: rank as a mapping must map glob strings to a positive int or "
                                 f"a list of positive ints, got {key!r}: {r!r}")
    elif not ok(rank):
        raise ValueError("convert: rank must be a positive int, a list of positive ints (one per bond) "
                         f"or a mapping {{glob: rank}}, got {rank!r}")


def _rank_for(rank, name: str):
    if not isinstance(rank, Mapping):
        return rank
    for pattern, r in rank.items():
        if fnmatch.fnmatchcase(name, pattern):
            return r
    return None


# ----------------------------------------------------------------- discovery
def _find_layers(model: nn.Module) -> List[_Layer]:
    """Every nn.Linear / nn.Embedding (subclasses included, so they can be
    reported) with all the (parent, attribute) places that hold it."""
    found: Dict[int, _Layer] = {}
    order: List[_Layer] = []

    def visit(name, module, parent, attr):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            layer = found.get(id(module))
            if layer is None:
                kind = "linear" if isinstance(module, nn.Linear) else "embedding"
                layer = found[id(module)] = _Layer(name, module, kind)
                order.append(layer)
            layer.places.append((parent, attr))

    visit("", model, None, "")
    names = []
    for pname, parent in model.named_modules():
        names.append(pname)
        for attr, child in parent._modules.items():
            if child is not None:
                visit(f"{pname}.{attr}" if pname else attr, child, parent, attr)
    rank_of = {n: i for i, n in enumerate(names)}
    return sorted(order, key=lambda l: rank_of.get(l.name, len(names)))


def _structural_reason(layer: _Layer) -> Optional[str]:
    """Why a layer cannot be converted whatever the options say."""
    m = layer.module
    if any(isinstance(parent, nn.MultiheadAttention) for parent, _ in layer.places):
        return "inside nn.MultiheadAttention, which reads out_proj.weight directly"
    if type(m) not in (nn.Linear, nn.Embedding):
        return f"{type(m).__name__} is a subclass whose forward may differ from its base"
    if m.weight.dtype not in _FLOAT:
        return f"weight dtype {m.weight.dtype} is not a floating type TT layers support"
    if layer.kind == "linear" and (m.in_features < 1 or m.out_features < 1):
        return "empty layer"
    if layer.kind == "embedding":
        if m.max_norm is not None or m.sparse or m.scale_grad_by_freq:
            return "max_norm / sparse / scale_grad_by_freq are not supported by TTEmbedding"
        if m.num_embeddings < 1 or m.embedding_dim < 1:
            return "empty layer"
    return None


def _selection_reason(layer: _Layer, include, exclude, embeddings: bool) -> Optional[str]:
    if layer.kind == "embedding" and not embeddings:
        return "embeddings=False"
    if include is not None and not any(fnmatch.fnmatchcase(layer.name, p) for p in include):
        return "not matched by include"
    if exclude is not None:
        for p in exclude:
            if fnmatch.fnmatchcase(layer.name, p):
                return f"excluded by {p!r}"
    return None


# ------------------------------------------------------------------- building
def _tt_dtype(m: nn.Module) -> torch.dtype:
    return m.weight.dtype


def _build_random(layer: _Layer, rank) -> nn.Module:
    m = layer.module
    factory = {"device": m.weight.device, "dtype": _tt_dtype(m)}
    try:
        if layer.kind == "linear":
            return TTLinear(m.in_features, m.out_features, bias=m.bias is not None, rank=rank, **factory)
        return TTEmbedding(m.num_embeddings, m.embedding_dim, rank=rank,
                           padding_idx=m.padding_idx, **factory)
    except (ValueError, TypeError) as err:
        raise ValueError(f"convert: cannot build a TT layer for '{layer.name}' ({layer.shape}) with "
                         f"rank={rank!r}: {err}") from err


@torch.no_grad()
def _match_scale(layer: _Layer) -> None:
    """Scales freshly drawn cores so the reconstructed weight has the mean
    square of the dense weight it replaces.  For a layer built with its
    default init this is that init's variance; for a model with its own init
    (HF models draw N(0, 0.02^2)) it keeps the model's scale.  A zero dense
    weight, or one on the meta device (no values yet: the model is
    initialised later, e.g. by ``to_empty`` + ``reset_parameters`` or by
    loading a checkpoint), keeps the TT layer's own default init."""
    if layer.module.weight.device.type == "meta":
        return
    target = layer.module.weight.detach().float().pow(2).mean().item()
    current = layer.new.weight.detach().float().pow(2).mean().item()
    if not (target > 0 and current > 0) or target == float("inf"):
        return
    cores = list(layer.new.cores)
    factor = (target / current) ** (1.0 / (2 * len(cores)))
    for c in cores:
        c.mul_(factor)


def _core_params(module: nn.Module) -> int:
    return sum(c.numel() for c in module.cores)


@torch.no_grad()
def _load_svd(layer: _Layer, rank) -> nn.Module:
    """The TT-SVD of the dense weight (bias handled by the caller)."""
    m, new = layer.module, layer.new
    if m.weight.device.type == "meta":
        raise ValueError(f"convert: init='svd' needs the weights of '{layer.name}', which is on "
                         "the meta device (no values): use init='random', or load the weights "
                         "first")
    if layer.kind == "linear":
        return new.load_dense_(m.weight, None)
    emb = TTEmbedding.from_dense(m, rank=rank)
    return emb.to(device=m.weight.device, dtype=_tt_dtype(m))


def _finish(layer: _Layer) -> None:
    """Bias, requires_grad and train/eval mode carried over from the dense layer."""
    old, new = layer.module, layer.new
    if layer.kind == "linear" and old.bias is not None:
        # the same Parameter: a bias shared with another module stays shared
        new.bias = old.bias
    trainable = old.weight.requires_grad
    for p in list(new.cores) + list(new.gates):
        p.requires_grad_(trainable)
    new.train(old.training)


# -------------------------------------------------------------------- summary
def _fmt(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _summary(layers: List[_Layer], init: str, before: int, after: int) -> str:
    done = [l for l in layers if l.reason is None]
    width = max([len(l.name or "<model>") for l in layers] + [5])
    lines = [f"comera.convert: {len(done)} of {len(layers)} Linear/Embedding layers converted (init={init!r})"]
    for l in layers:
        head = f"  {(l.name or '<model>'):<{width}}  {l.kind:<9}  {l.shape:<13}"
        if l.reason is None:
            if l.tied_to is not None:
                lines.append(f"{head}  tied -> {type(l.new).__name__} sharing the TT weight of "
                             f"'{l.tied_to}'")
            else:
                lines.append(f"{head}  {_fmt(l.dense_params):>7} -> {_fmt(l.tt_params):>7}  "
                             f"{l.dense_params / max(l.tt_params, 1):7.1f}x  ranks {list(l.new.ranks)}")
        else:
            lines.append(f"{head}  dense: {l.reason}")
    dense = sum(l.dense_params for l in done)
    tt = sum(l.tt_params for l in done)
    if done:
        lines.append(f"  converted layers: {_fmt(dense)} -> {_fmt(tt)} weight parameters "
                     f"({dense / max(tt, 1):.1f}x); model: {_fmt(before)} -> {_fmt(after)} parameters")
    return "\n".join(lines)


# ------------------------------------------------------------------ public API
def convert(model: nn.Module, *, rank: RankSpec, include: Patterns = None, exclude: Patterns = None,
            embeddings: bool = True, init: str = "random", min_compression: float = 1.0,
            tie: str = "keep") -> nn.Module:
    """Replaces ``model``'s nn.Linear (and nn.Embedding) layers by TT layers, in place.

    Args:
        model: any nn.Module (a bare nn.Linear/nn.Embedding is replaced by the
            returned layer, since it cannot be swapped in place).
        rank: the TT rank: an int (every bond, capped at its bound), a list of
            ints (one per bond; every converted layer must have that many), or a
            mapping ``{glob: rank}`` where the first matching glob wins and
            layers that match none stay dense.
        include, exclude: glob patterns (fnmatch, ``*`` matches dots too) on
            qualified module names; a layer converts when it matches some
            ``include`` pattern (``None``: all) and no ``exclude`` pattern.
        embeddings: also convert nn.Embedding layers (to comera.TTEmbedding).
        init: ``"random"`` (random cores, scaled so the reconstructed weight
            has the mean square of the dense weight it replaces: the default
            init's variance for a freshly built layer, the model's own scale
            otherwise) or ``"svd"`` (TT-SVD of the current dense weight,
            truncated to ``rank``).  Biases
            are not compressed: the bias Parameter itself is kept in both modes.
        min_compression: keep a layer dense unless dense weight parameters /
            TT core parameters >= this.
        tie: what to do with layers whose weight is one Parameter shared with
            another module (e.g. BERT's ``cls.predictions.decoder`` and
            ``bert.embeddings.word_embeddings``).  ``"keep"`` (default): a tied
            group converts together or stays dense together; a Linear tied to
            an embedding becomes a :class:`comera.layers.tied.TiedTTLinear` that reads
            the TTEmbedding's table, so the tie holds while training.
            ``"untie"``: every layer gets its own TT weight (logged as a
            warning).  ``"skip"``: tied layers stay dense.

    Device, dtype (float32, float64, bfloat16, float16: a bfloat16 model gets
    bfloat16 cores; on the CPU their math runs in float32) and train/eval
    mode are kept; frozen weights give frozen cores.  A model built on the
    meta device converts too (``init="random"``): its TT layers are on the
    meta device and get values from ``to_empty`` + ``reset_parameters`` or a
    checkpoint.  nn.Linear/nn.Embedding
    subclasses and the out_proj of nn.MultiheadAttention (which reads the
    weight directly) stay dense.  A per-layer summary is logged (logger
    ``"comera"``, level INFO).  Returns ``model``.

    Example:
        >>> import torch, comera
        >>> net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
        ...                           torch.nn.Linear(512, 10))
        >>> net = comera.convert(net, rank=8, exclude="2")
        >>> [type(m).__name__ for m in net]
        ['TTLinear', 'ReLU', 'Linear']
        >>> net(torch.randn(4, 256)).shape
        torch.Size([4, 10])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    _check_rank(rank)
    include, exclude = _patterns(include, "include"), _patterns(exclude, "exclude")
    if not isinstance(embeddings, bool):
        raise TypeError(f"convert: embeddings must be a bool, got {embeddings!r}")
    if init not in ("random", "svd"):
        raise ValueError(f"convert: init must be 'random' or 'svd', got {init!r}")
    if isinstance(min_compression, bool) or not isinstance(min_compression, (int, float)) \
            or not min_compression > 0:
        raise ValueError(f"convert: min_compression must be a number > 0, got {min_compression!r}")
    if tie not in _TIES:
        raise ValueError(f"convert: tie must be one of {_TIES}, got {tie!r}")

    before = sum(p.numel() for p in model.parameters())
    layers = _find_layers(model)
    for pattern in include or []:
        if not any(fnmatch.fnmatchcase(l.name, pattern) for l in layers):
            logger.warning("comera.convert: include pattern %r matches no Linear/Embedding layer", pattern)

    # 1. which layers are wanted, and with which rank
    for l in layers:
        l.reason = _structural_reason(l) or _selection_reason(l, include, exclude, embeddings)
        if l.reason is None:
            l.rank = _rank_for(rank, l.name)
            if l.rank is None:
                l.reason = "no rank pattern matches its name"

    # 2. build (random init, cheap) to count TT parameters; apply min_compression
    # (not to a Linear tied to an embedding: with tie="keep" it costs nothing of its own)
    emb_weights = {id(l.module.weight) for l in layers if l.kind == "embedding"}
    for l in layers:
        if l.reason is not None:
            continue
        l.new = _build_random(l, l.rank)
        l.tt_params = _core_params(l.new)
        ratio = l.dense_params / l.tt_params
        exempt = tie == "keep" and l.kind == "linear" and id(l.module.weight) in emb_weights
        if ratio < min_compression and not exempt:
            l.reason = f"compression {ratio:.2f}x < min_compression {min_compression}"
            l.new = None

    # 3. ties
    keep_plan, broken = resolve_ties(model, layers, tie)
    for l in layers:
        if l.reason is not None:
            l.new = None
    for desc in broken:
        logger.warning("comera.convert: untying %s (tie='untie'): each gets its own TT weight", desc)

    # 4. initial values, bias, flags (not for tied members that will share another's TT weight)
    followers = {id(m) for _, members in keep_plan for m in members if m is not group_source(members)}
    for l in layers:
        if l.new is None or id(l) in followers:
            continue
        if init == "svd":
            l.new = _load_svd(l, l.rank)
            l.tt_params = _core_params(l.new)
        else:
            _match_scale(l)
        _finish(l)

    # 5. tied groups share one TT module (an embedding's table feeds the tied Linears)
    for _, members in keep_plan:
        source = group_source(members)
        for m in members:
            if m is source:
                continue
            if m.kind == source.kind:
                m.new = source.new
                if m.kind == "linear" and m.module.bias is not None:
                    source.new.bias = m.module.bias
            else:
                tied = TiedTTLinear(source.new, bias=m.module.bias)
                tied.train(m.module.training)
                m.new = tied
            m.tt_params = 0
            m.tied_to = source.name

    # 6. swap them in
    result = model
    for l in layers:
        if l.reason is not None:
            continue
        for parent, attr in l.places:
            if parent is None:
                result = l.new
            else:
                setattr(parent, attr, l.new)

    if any(l.reason is None for l in layers) and result is model:
        for hook in _after_convert:
            hook(model, bool(keep_plan or broken))
    after = sum(p.numel() for p in result.parameters())
    logger.info("%s", _summary(layers, init, before, after))
    return result


def to_dense(model: nn.Module) -> nn.Module:
    """Replaces every TT layer in ``model`` by its dense equivalent, in place.

    TTLinear -> nn.Linear, TTEmbedding -> nn.Embedding (same weights as the TT
    reconstruction), and a TiedTTLinear becomes an nn.Linear whose weight IS
    the densified embedding's weight Parameter (the tie restored).  Biases
    keep their Parameter objects; device, dtype, train/eval mode and
    requires_grad are kept.  Returns ``model`` (or the dense layer when
    ``model`` itself is a TT layer).

    Example:
        >>> import torch, comera
        >>> net = comera.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), rank=4)
        >>> x = torch.randn(2, 64)
        >>> y = net(x)
        >>> net = comera.to_dense(net)
        >>> type(net[0]).__name__, torch.allclose(net(x), y, atol=1e-5)
        ('Linear', True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_dense: model must be an nn.Module, got {type(model).__name__}")
    tt_types = (TTLinear, TTEmbedding)
    dense: Dict[int, nn.Module] = {}

    def densify(module: nn.Module) -> nn.Module:
        if id(module) in dense:
            return dense[id(module)]
        trainable = any(p.requires_grad for p in module.parameters()) if list(module.parameters()) else True
        if isinstance(module, TiedTTLinear):
            src = module.embedding
            emb = densify(src) if isinstance(src, tt_types) else None
            if emb is not None:
                w = module.weight
                new = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                device=w.device, dtype=w.dtype)
                new.weight = emb.weight                                  # re-tie
            else:
                new = module.to_dense()
        else:
            new = module.to_dense()
            new.weight.requires_grad_(trainable)
        if getattr(module, "bias", None) is not None and isinstance(module.bias, nn.Parameter):
            new.bias = module.bias
        new.train(module.training)
        dense[id(module)] = new
        return new

    if isinstance(model, tt_types + (TiedTTLinear,)):
        return densify(model)
    changed = False
    for _, parent in list(model.named_modules()):
        for attr, child in list(parent._modules.items()):
            if isinstance(child, tt_types + (TiedTTLinear,)):
                setattr(parent, attr, densify(child))
                changed = True
    if changed:
        for hook in _after_to_dense:
            hook(model)
    return model


def converted_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, layer) for every TT layer and tied TT head in ``model``."""
    kinds = (TTLinear, TTEmbedding, TiedTTLinear)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]
