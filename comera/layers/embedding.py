"""TTEmbedding: a drop-in replacement for nn.Embedding / nn.EmbeddingBag with a
tensor-train (TTM-format) table."""
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from comera.layers import tt
from comera.layers.base import TTLayerMixin, cores_and_gates, replace_data
from comera.ops.dense import ttm_full
from comera.ops.embedding import MODES, REUSE, tt_embedding, tt_embedding_plan, tt_embedding_rows
from comera.ops.gpu_cost import tt_embedding_gpu_cost

DEFAULT_CORES = 3
_HALF = (torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int64, torch.int32)


def arrange_row_modes(row_modes: Sequence[int]) -> List[int]:
    """Orders row factors so the two largest sit on the end cores.

    An interior core costs ``r^2 v e`` parameters, an end core only ``r v e``,
    so the smallest factors belong inside: 30522 -> [37, 25, 33] with dim
    modes [8, 8, 12] takes 227k parameters at rank 32, [25, 33, 37] 291k.
    The largest factor goes first, against the smallest dim mode; the
    interior is descending, against ascending dim modes.

    Example:
        >>> arrange_row_modes([25, 33, 37]), arrange_row_modes([12, 13, 14, 14])
        ([37, 25, 33], [14, 13, 12, 14])
    """
    v = sorted(row_modes)
    if len(v) < 3:
        return v[::-1]
    return [v[-1]] + v[-3::-1] + [v[-2]]


def default_shape(num_embeddings: int, embedding_dim: int,
                  num_cores: int = DEFAULT_CORES) -> Tuple[List[int], List[int]]:
    """Row and dim modes used when ``shape`` is not given (or is a core count).

    Example:
        >>> default_shape(30522, 768)
        ([37, 25, 33], [8, 8, 12])
        >>> default_shape(1000000, 64)
        ([100, 100, 100], [4, 4, 4])
    """
    rows = arrange_row_modes(tt.factorize(num_embeddings, num_cores))
    return rows, tt.factorize(embedding_dim, num_cores)


def _check_shape(shape, num_embeddings, embedding_dim):
    if shape is None:
        return default_shape(num_embeddings, embedding_dim)
    if isinstance(shape, int) and not isinstance(shape, bool):
        if not 2 <= shape <= 16:
            raise ValueError(f"shape as a core count must be in [2, 16], got {shape}")
        return default_shape(num_embeddings, embedding_dim, shape)
    try:
        rows, dims = (list(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError("shape must be None, a core count, or a pair (row_modes, dim_modes), "
                         f"got {shape!r}") from None
    for name, modes in (("row_modes", rows), ("dim_modes", dims)):
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in modes):
            raise ValueError(f"shape {name} must be positive ints, got {modes}")
    if len(rows) != len(dims) or not 2 <= len(rows) <= 16:
        raise ValueError(f"shape needs as many row modes as dim modes, 2 to 16 each, got "
                         f"{len(rows)} and {len(dims)}")
    for name, modes in (("row_modes", rows), ("dim_modes", dims)):
        if math.prod(modes) > tt.INT64_MAX:
            raise ValueError(f"shape {name} {modes} have product {math.prod(modes)}, which "
                             "overflows int64")
    if math.prod(rows) < num_embeddings:
        raise ValueError(f"shape row_modes {rows} have product {math.prod(rows)}, expected "
                         f">= num_embeddings={num_embeddings}")
    if math.prod(dims) < embedding_dim:
        raise ValueError(f"shape dim_modes {dims} have product {math.prod(dims)}, expected "
                         f">= embedding_dim={embedding_dim}")
    return rows, dims


class TTEmbedding(TTLayerMixin, nn.Module):
    r"""An embedding table stored as a tensor train (docs/design.md section 3).

    Row ``t`` has the row-major multi-index ``(i_1..i_d)`` over ``row_shape``
    and is the product of the core slices ``C_k[:, i_k]``, each of shape
    ``(r_{k-1}, e_k, r_k)``, with a gate vector on every internal bond.  The
    lookup runs in C: each distinct index is contracted once, rows that share
    a prefix share its partial product, and gradients are summed per row
    before they reach the cores.

    Args:
        num_embeddings, embedding_dim, padding_idx: as for :class:`torch.nn.Embedding`
            (the padding row reads as zero and gets no gradient).
        rank: an int (every internal bond, capped at its TT bound) or a list of
            ``d - 1`` ints; default 8, as for :class:`comera.TTLinear`.
        shape: ``None`` (3 cores: balanced factors, row count rounded up to a
            product, the largest row factors on the end cores), a core count, or
            a pair ``(row_modes, dim_modes)`` of equal length >= 2.
        mode: ``None`` (plain lookups), ``"sum"`` or ``"mean"`` (bags, as
            :class:`torch.nn.EmbeddingBag`).
        include_last_offset: as for :class:`torch.nn.EmbeddingBag`.
        reuse: lookup strategy, ``"auto"`` (planner), ``"none"``, ``"dedup"``
            or ``"prefix"``; a plain attribute, so it can be switched later.
        capturable: on CUDA, skip the host-side check of the indices (one
            synchronisation per call), so that forward and backward can be
            captured in a CUDA graph (``torch.cuda.graphs``); the kernels'
            buffers are always sized by the number of indices, padded, never
            by the data.  An index out of range then reads as a NaN row.  On
            the CPU the results are the same either way.  A plain attribute.

    Example:
        >>> import torch, comera
        >>> emb = comera.TTEmbedding(30522, 768, rank=32)
        >>> emb.row_shape, emb.dim_shape, emb.ranks
        ([37, 25, 33], [8, 8, 12], [32, 32])
        >>> round(emb.compression())
        103
        >>> emb(torch.tensor([[101, 2054, 102]])).shape
        torch.Size([1, 3, 768])
        >>> bag = comera.TTEmbedding(1000, 16, rank=4, mode="mean")
        >>> bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3])).shape
        torch.Size([2, 16])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 rank: Union[int, Sequence[int]] = 8,
                 shape: Union[None, int, Tuple[Sequence[int], Sequence[int]]] = None,
                 padding_idx: Optional[int] = None, mode: Optional[str] = None,
                 include_last_offset: bool = False, reuse: str = "auto",
                 capturable: bool = False, device=None, dtype=None):
        super().__init__()
        tt.check_sizes(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
                raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings: expected "
                                 f"{-num_embeddings} <= padding_idx < {num_embeddings}, "
                                 f"got {padding_idx}")
            padding_idx %= num_embeddings
        if mode not in MODES:
            raise ValueError(f"mode must be None, 'sum' or 'mean', got {mode!r}")
        if reuse not in REUSE:
            raise ValueError(f"reuse must be one of {sorted(REUSE)}, got {reuse!r}")
        dtype = tt.layer_dtype(dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.mode = padding_idx, mode
        self.include_last_offset = bool(include_last_offset)
        self.reuse = reuse
        self.capturable = bool(capturable)
        self.row_shape, self.dim_shape = _check_shape(shape, num_embeddings, embedding_dim)
        dims = [v * e for v, e in zip(self.row_shape, self.dim_shape)]
        ranks = tt.resolve_ranks(rank, dims)
        self._check_fits(ranks)
        full = [1] + ranks + [1]
        factory = {"device": device, "dtype": dtype}
        self.cores = nn.ParameterList(
            nn.Parameter(torch.empty(full[k], self.row_shape[k], self.dim_shape[k], full[k + 1],
                                     **factory))
            for k in range(len(dims)))
        self.gates = nn.ParameterList(nn.Parameter(torch.empty(r, **factory)) for r in ranks)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws the construction-time initialisation again, in place (for the
        current ranks): cores with iid normal entries scaled so the table has
        unit variance, like nn.Embedding's N(0, 1); gates 1.  The padding row
        reads as zero whatever the cores hold.  Works after ``to_empty()`` of
        a layer built on the meta device.

        Example:
            >>> import torch, comera
            >>> with torch.device("meta"):
            ...     emb = comera.TTEmbedding(30522, 768, rank=8, padding_idx=0)
            >>> emb = emb.to_empty(device="cpu")
            >>> emb.reset_parameters()
            >>> emb(torch.tensor([0, 5])).abs().sum(-1).gt(0).tolist()
            [False, True]
        """
        std = tt.init_std(len(self.cores), self.ranks, 1.0)
        tt.normal_cores_(list(self.cores), std)
        for g in self.gates:
            g.fill_(1)

    def _check_fits(self, ranks):
        """Sizes whose products overflow int64 are refused before the cores
        are allocated, with the arguments named (the cores, then the C
        kernels' own checks of every size they derive)."""
        full = [1] + list(ranks) + [1]
        tt.check_core_sizes("TTEmbedding", [(full[k], v, e, full[k + 1]) for k, (v, e) in
                                            enumerate(zip(self.row_shape, self.dim_shape))],
                            "shape and rank")
        try:
            # an explicit CPU tensor: under `with torch.device("meta")` the
            # planner still gets real (empty) indices
            torch.ops.comera.tt_embedding_plan(
                torch.empty(0, dtype=torch.int64, device="cpu"), None, list(self.row_shape),
                list(self.dim_shape), full, self.num_embeddings, self.embedding_dim, -1, 0)
        except ValueError as err:
            raise ValueError(f"TTEmbedding: shape ({self.row_shape}, {self.dim_shape}) and ranks "
                             f"{ranks} give sizes the kernels cannot index with int64 "
                             f"({str(err).splitlines()[0]})") from None

    # ----------------------------------------------------------------- shape
    @property
    def ranks(self) -> List[int]:
        """Current internal ranks, read from the cores (they may have been pruned)."""
        return [c.shape[-1] for c in list(self.cores)[:-1]]

    @property
    def shape(self) -> Tuple[List[int], List[int]]:
        """``(row_shape, dim_shape)``."""
        return list(self.row_shape), list(self.dim_shape)

    def tt_params(self) -> int:
        """Parameters in the cores (live ranks only once pruned)."""
        return sum(c.numel() for c in self.cores)

    def compression(self) -> float:
        """Dense table parameters over TT core parameters."""
        return self.num_embeddings * self.embedding_dim / self.tt_params()

    @torch.no_grad()
    def resize_rows_(self, num_embeddings: int) -> List[int]:
        """Gives the table ``num_embeddings`` rows, every kept row bit-exact.

        Rows are numbered row-major over ``row_shape``: the leading row mode
        (core 0) is the most significant digit, so changing its size keeps
        the multi-index, hence the core slices, of every row below the new
        count.  The row space grows or shrinks by whole slices of core 0
        (``prod(row_shape[1:])`` rows each); rows that land in the padding of
        the current row space read what the cores already give there, and
        each added slice of core 0 is zero until the caller sets it (docs/design.md
        section 3).  The Parameter objects are kept, their data replaced.
        Returns the indices of the added slices of core 0.

        Example:
            >>> import torch, comera
            >>> emb = comera.TTEmbedding(99, 32, rank=4)
            >>> before = emb.weight
            >>> emb.resize_rows_(109), emb.row_shape
            ([5], [6, 4, 5])
            >>> torch.equal(emb.weight[:99], before)
            True
        """
        tt.check_sizes(num_embeddings=num_embeddings)
        if self.padding_idx is not None and self.padding_idx >= num_embeddings:
            raise ValueError(f"resize_rows_: padding_idx {self.padding_idx} would not be a row of "
                             f"a table of {num_embeddings} rows")
        core = self.cores[0]
        old, old_rows = self.row_shape[0], self.num_embeddings
        new = -(-num_embeddings // math.prod(self.row_shape[1:]))
        self.row_shape[0], self.num_embeddings = new, num_embeddings
        try:
            self._check_fits(self.ranks)
        except ValueError:
            self.row_shape[0], self.num_embeddings = old, old_rows
            raise
        if new != old:
            added = torch.zeros(core.shape[0], max(new - old, 0), *core.shape[2:],
                                dtype=core.dtype, device=core.device)
            replace_data(core, torch.cat([core.detach()[:, :min(old, new)], added], dim=1))
            core.grad = None
        return list(range(old, new))

    # --------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Plain mode: ``input`` of any shape -> ``(*input.shape, embedding_dim)``.
        Bag modes: as :meth:`torch.nn.EmbeddingBag.forward`."""
        cores, gates = cores_and_gates(self)
        if (offsets is None and per_sample_weights is None and self.mode is None
                and isinstance(input, torch.Tensor) and input.dtype in _INDEX_DTYPES):
            # a plain lookup (tt_embedding_rows checks the devices)
            return tt_embedding_rows(input, cores, gates, self.num_embeddings,
                                     self.embedding_dim, self.padding_idx, self.reuse,
                                     self.capturable)
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"TTEmbedding expects a Tensor of indices, got {type(input).__name__}")
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TTEmbedding input must be an int64 or int32 tensor of indices, "
                            f"got {input.dtype}")
        w = cores[0]
        if input.device != w.device:
            raise ValueError(f"TTEmbedding input is on {input.device} but the layer is on {w.device}")
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("offsets and per_sample_weights need a bag layer "
                             "(TTEmbedding(..., mode='sum' or 'mean'))")
        return tt_embedding(input, cores, gates, self.num_embeddings,
                            self.embedding_dim, offsets=offsets,
                            per_sample_weights=per_sample_weights, padding_idx=self.padding_idx,
                            mode=self.mode, include_last_offset=self.include_last_offset,
                            reuse=self.reuse, capturable=self.capturable)

    # ------------------------------------------------------------ inspection
    def plan(self, input: torch.Tensor, *, device=None, gpu: str = "H200") -> dict:
        """The C planner's numbers for looking up ``input``: distinct rows,
        distinct prefixes per level, modelled flops per strategy.

        For ``device="cuda"`` (default: the layer's device) it is instead the
        GPU cost model of :func:`comera.ops.gpu_cost.tt_embedding_gpu_cost`
        on ``gpu`` (``"H100"`` or ``"H200"``) for one forward + backward of
        ``input`` (a 2-D ``input`` in bag mode: one bag per row): FLOPs,
        bytes, launches and predicted seconds of every CUDA launch.

        Example:
            >>> import torch, comera
            >>> emb = comera.TTEmbedding(1000, 64, rank=8)
            >>> p = emb.plan(torch.tensor([3, 3, 3, 7]))
            >>> p["rows"], p["unique"], p["flops"]["dedup"] < p["flops"]["none"]
            (4, 2, True)
            >>> emb.plan(torch.zeros(4096, dtype=torch.long), device="cuda")["forward"]["launches"]
            {'kernel': 12, 'blas': 0, 'copy': 0}
        """
        if torch.device(self.cores[0].device if device is None else device).type == "cuda":
            bags = input.shape[0] if input.dim() == 2 else 1
            return tt_embedding_gpu_cost(self.row_shape, self.dim_shape, [1] + self.ranks + [1],
                                         self.num_embeddings, self.embedding_dim, input.numel(),
                                         self.cores[0].dtype, mode=self.mode or "plain",
                                         num_bags=bags, reuse=self.reuse, gpu=gpu)
        return tt_embedding_plan(input, self.row_shape, self.dim_shape, [1] + self.ranks + [1],
                                 self.num_embeddings, self.embedding_dim, self.padding_idx)

    @property
    def weight(self) -> torch.Tensor:
        """The reconstructed table ``(num_embeddings, embedding_dim)``, padding
        row zero (differentiable; for bfloat16/float16 layers computed in
        float32 and rounded once to the layer's dtype)."""
        cores, gates = list(self.cores), list(self.gates)
        dtype = cores[0].dtype
        if dtype in _HALF:  # float32 math, as in forward
            cores, gates = [c.float() for c in cores], [g.float() for g in gates]
        full = ttm_full(cores, gates)
        w = full[: self.num_embeddings, : self.embedding_dim]
        if self.padding_idx is not None:
            keep = torch.ones(self.num_embeddings, 1, dtype=w.dtype, device=w.device)
            keep[self.padding_idx] = 0
            w = w * keep
        return w.to(dtype)

    def to_dense(self) -> Union[nn.Embedding, nn.EmbeddingBag]:
        """An equivalent :class:`torch.nn.Embedding` (or :class:`torch.nn.EmbeddingBag`
        in bag mode).

        Example:
            >>> import torch, comera
            >>> emb = comera.TTEmbedding(50, 6, rank=3, padding_idx=0)
            >>> idx = torch.tensor([0, 7, 49])
            >>> torch.allclose(emb.to_dense()(idx), emb(idx), atol=1e-6)
            True
        """
        w = self.cores[0]
        kw = dict(padding_idx=self.padding_idx, device=w.device, dtype=w.dtype)
        if self.mode is None:
            dense = nn.Embedding(self.num_embeddings, self.embedding_dim, **kw)
        else:
            dense = nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, mode=self.mode,
                                    include_last_offset=self.include_last_offset, **kw)
        with torch.no_grad():
            dense.weight.copy_(self.weight)
        return dense

    @classmethod
    def from_dense(cls, embedding_or_weight: Union[nn.Embedding, nn.EmbeddingBag, torch.Tensor],
                   rank: Union[int, Sequence[int]] = 8, *, shape=None,
                   padding_idx: Optional[int] = None, mode: Optional[str] = None,
                   reuse: str = "auto") -> "TTEmbedding":
        """A TTEmbedding whose table is the TT-SVD of a dense one, truncated to ``rank``.
        ``padding_idx``, ``mode`` and ``include_last_offset`` are taken from an
        nn.Embedding / nn.EmbeddingBag unless given.

        Example:
            >>> import torch, comera
            >>> bag = torch.nn.EmbeddingBag(24, 6, mode="mean")
            >>> tt = comera.TTEmbedding.from_dense(bag, rank=1000)   # full rank: exact
            >>> tt.mode, torch.allclose(tt.weight, bag.weight, atol=1e-5)
            ('mean', True)
        """
        weight, dtype = tt.dense_source(embedding_or_weight, (nn.Embedding, nn.EmbeddingBag),
                                        "(num_embeddings, embedding_dim)")
        include_last_offset = False
        if isinstance(embedding_or_weight, (nn.Embedding, nn.EmbeddingBag)):
            padding_idx = embedding_or_weight.padding_idx if padding_idx is None else padding_idx
        if isinstance(embedding_or_weight, nn.EmbeddingBag):
            if embedding_or_weight.mode == "max":
                raise ValueError("from_dense: nn.EmbeddingBag mode 'max' has no TT counterpart")
            mode = embedding_or_weight.mode if mode is None else mode
            include_last_offset = embedding_or_weight.include_last_offset
        num, dim = weight.shape
        layer = cls(num, dim, rank=rank, shape=shape, padding_idx=padding_idx, mode=mode,
                    include_last_offset=include_last_offset, reuse=reuse,
                    device=weight.device, dtype=dtype)
        return layer.load_dense_(weight)

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor) -> "TTEmbedding":
        """Overwrites the cores with the TT-SVD of ``weight`` (gates reset to 1);
        ranks may shrink where the TT bound is lower."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight must have shape ({self.num_embeddings}, "
                             f"{self.embedding_dim}), got {tuple(weight.shape)}")
        v, e, d = self.row_shape, self.dim_shape, len(self.row_shape)
        full = torch.zeros(math.prod(v), math.prod(e), dtype=torch.float64, device=weight.device)
        full[: self.num_embeddings, : self.embedding_dim] = weight.detach().to(torch.float64)
        # (i_1..i_d, j_1..j_d) -> (i_1, j_1, i_2, j_2, ...): one TT mode per core
        perm = [x for k in range(d) for x in (k, d + k)]
        t = full.reshape(*v, *e).permute(*perm)
        new = tt.tt_svd(t, [a * b for a, b in zip(v, e)], self.ranks)
        for p, c, a, b in zip(self.cores, new, v, e):
            p.data = c.reshape(c.shape[0], a, b, c.shape[-1]).to(p.dtype)
        for g, c in zip(self.gates, new[:-1]):
            g.data = torch.ones(c.shape[-1], dtype=g.dtype, device=g.device)
        return self

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings}, {self.embedding_dim}, row_shape={self.row_shape}, "
             f"dim_shape={self.dim_shape}, ranks={self.ranks}, params={self.tt_params()}, "
             f"compression={self.compression():.1f}x")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.mode is not None:
            s += f", mode={self.mode!r}"
        if self.capturable:
            s += ", capturable=True"
        return s
