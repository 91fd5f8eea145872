"""TTLinear: a drop-in replacement for nn.Linear with a tensor-train weight."""
import math
import operator
from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from comera.layers import tt
from comera.layers.base import TTLayerMixin, cores_and_gates
from comera.ops import route
from comera.ops.dense import dense_wt
from comera.ops.gpu_cost import tt_linear_gpu_plan
from comera.ops.linear import Prepared, tt_linear_prepared
from comera.ops.linear_plan import PATHS, tt_linear_plan

_HALF = (torch.bfloat16, torch.float16)


def _check_shape(shape, features, name):
    if shape is None:
        return None
    shape = list(shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {shape}")
    if math.prod(shape) > tt.INT64_MAX:
        raise ValueError(f"{name} {shape} has product {math.prod(shape)}, which overflows int64")
    if math.prod(shape) < features:
        raise ValueError(f"{name} {shape} has product {math.prod(shape)}, expected a product "
                         f">= {features} (normally exactly {features})")
    if math.prod(shape) != features and math.prod(shape[:-1]) * (shape[-1] - 1) >= features:
        raise ValueError(f"{name} {shape} has product {math.prod(shape)}, expected {features}: "
                         "padding is only allowed up to the next multiple of the other modes")
    return shape


def _check_fits(in_shape, out_shape, ranks, in_features, out_features):
    """Sizes whose products overflow int64 are refused here, before the cores
    are allocated, with the arguments named: the cores themselves, then every
    size the C kernels derive (the C planner's own overflow checks)."""
    full = [1] + list(ranks) + [1]
    dims = list(in_shape) + list(out_shape)
    tt.check_core_sizes("TTLinear", [(full[k], n, full[k + 1]) for k, n in enumerate(dims)],
                        "in_shape, out_shape and rank")
    try:
        tt_linear_plan(in_shape, out_shape, full, in_features, out_features, 1)
    except ValueError as err:
        raise ValueError(f"TTLinear: in_shape {in_shape}, out_shape {out_shape} and ranks {ranks} "
                         f"give sizes the kernels cannot index with int64 "
                         f"({str(err).splitlines()[0]})") from None


def _plan_rows(batch) -> int:
    """``batch`` of :meth:`TTLinear.plan` as an int (an integer of any kind,
    a one-element integer tensor), or a clear error."""
    try:
        if isinstance(batch, bool):
            raise TypeError
        rows = operator.index(batch)
    except TypeError:
        raise TypeError(f"TTLinear.plan: batch must be an int (the rows of an input), got "
                        f"{type(batch).__name__}") from None
    if rows < 0:
        raise ValueError(f"TTLinear.plan: batch must be >= 0, got {rows}")
    return rows


class TTLinear(TTLayerMixin, nn.Module):
    r"""``y = x W^T + b`` with ``W`` stored as a tensor train (docs/design.md section 2).

    Args:
        in_features, out_features: as for :class:`torch.nn.Linear`.
        bias: learn an additive bias.
        rank: an int (every internal bond, capped at its TT bound) or a list of
            ``len(in_shape) + len(out_shape) - 1`` ints.
        in_shape, out_shape: the mode sizes; default a balanced factorisation
            (768 -> [8, 8, 12]); a product larger than the feature count pads.
        path: ``"auto"`` (the C planner decides per call), ``"merge"`` or
            ``"sequential"``.

    Example:
        >>> import torch, comera
        >>> layer = comera.TTLinear(768, 3072, rank=16)
        >>> layer.in_shape, layer.out_shape, layer.ranks
        ([8, 8, 12], [12, 16, 16], [8, 16, 16, 16, 16])
        >>> layer(torch.randn(2, 5, 768)).shape
        torch.Size([2, 5, 3072])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rank: Union[int, Sequence[int]] = 8, in_shape: Optional[Sequence[int]] = None,
                 out_shape: Optional[Sequence[int]] = None, path: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        tt.check_sizes(in_features=in_features, out_features=out_features)
        dtype = tt.layer_dtype(dtype)
        if path not in PATHS:
            raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
        self.in_features, self.out_features = in_features, out_features
        self.in_shape = _check_shape(in_shape, in_features, "in_shape") or tt.factorize(in_features)
        self.out_shape = _check_shape(out_shape, out_features, "out_shape") or tt.factorize(out_features)
        self.path = path
        dims = self.in_shape + self.out_shape
        ranks = tt.resolve_ranks(rank, dims)
        _check_fits(self.in_shape, self.out_shape, ranks, in_features, out_features)
        full = [1] + ranks + [1]
        factory = {"device": device, "dtype": dtype}
        self.cores = nn.ParameterList(
            nn.Parameter(torch.empty(full[k], dims[k], full[k + 1], **factory))
            for k in range(len(dims)))
        self.gates = nn.ParameterList(nn.Parameter(torch.empty(r, **factory)) for r in ranks)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self._prepared = Prepared()  # per parameter version: see comera.ops.linear
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws the construction-time initialisation again, in place (for the
        current ranks): cores with iid normal entries scaled so the weight has
        variance ``1 / (3 in_features)``, like nn.Linear's; gates 1; bias
        uniform in ``+-1/sqrt(in_features)``.  Works after ``to_empty()`` of a
        layer built on the meta device.

        Example:
            >>> import torch, comera
            >>> with torch.device("meta"):
            ...     layer = comera.TTLinear(64, 32, rank=4)
            >>> layer = layer.to_empty(device="cpu")
            >>> layer.reset_parameters()
            >>> bool(layer.weight.abs().sum() > 0)
            True
        """
        std = tt.init_std(len(self.cores), self.ranks, 1.0 / (3.0 * self.in_features))
        tt.normal_cores_(list(self.cores), std)
        for g in self.gates:
            g.fill_(1)
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias.uniform_(-bound, bound)

    def clear_prepared(self) -> None:
        """Drops what the layer keeps per parameter version (its merged ``V``
        and ``U``, :class:`comera.ops.linear.Prepared`).  In-place updates,
        ``.to()`` and a call with gradients renew them by themselves; call this
        after writing a parameter through ``param.data``.

        Example:
            >>> import torch, comera
            >>> layer = comera.TTLinear(16, 8, rank=2)
            >>> layer.cores[0].data = torch.zeros_like(layer.cores[0])
            >>> layer.clear_prepared()
            >>> with torch.no_grad():
            ...     bool(layer(torch.randn(1, 16)).sub(layer.bias).abs().max() == 0)
            True
        """
        self._prepared.clear()

    def _apply(self, fn, recurse=True):  # .to(), .double(), .cuda(), to_empty(): new data
        self._prepared.clear()
        return super()._apply(fn, recurse)

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_prepared" not in self.__dict__:  # pickled before the layer kept one
            self._prepared = Prepared()

    # ----------------------------------------------------------------- shape
    @property
    def ranks(self) -> List[int]:
        """Current internal ranks (one per bond, input side first)."""
        return [c.shape[-1] for c in list(self.cores)[:-1]]

    @property
    def num_in_cores(self) -> int:
        return len(self.in_shape)

    def tt_params(self) -> int:
        """Parameters in the cores (live ranks only once pruned)."""
        return sum(c.numel() for c in self.cores)

    def compression(self) -> float:
        """Dense weight parameters over TT core parameters."""
        return self.in_features * self.out_features / self.tt_params()

    # --------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` of shape ``(*, in_features)`` -> ``(*, out_features)``, as
        :meth:`torch.nn.Linear.forward` (its argument has the same name)."""
        x, (cores, gates) = input, cores_and_gates(self)
        w = cores[0]
        if not (isinstance(x, torch.Tensor) and x.dtype == w.dtype and x.ndim
                and x.shape[-1] == self.in_features and x.device == w.device):
            self._check_input(x, w)  # raises, or accepts a 16-bit x or autocast
        # the dict, not self.bias: nn.Module.__getattr__ costs half a microsecond
        return tt_linear_prepared(x, cores, gates, self._parameters["bias"],
                                  len(self.in_shape), self.out_features, self.path,
                                  self._prepared)

    def _check_input(self, x, w) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"TTLinear expects a Tensor input, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"TTLinear input must be a floating-point tensor, got {x.dtype}")
        if x.dtype != w.dtype and not (x.dtype in _HALF and w.dtype == torch.float32) \
                and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"TTLinear input dtype {x.dtype} does not match the layer's {w.dtype} "
                            "(bfloat16/float16 input is accepted by float32 layers)")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"TTLinear input must have shape (*, in_features={self.in_features}), "
                             f"got {tuple(x.shape)}")
        if x.device != w.device:
            raise ValueError(f"TTLinear input is on {x.device} but the layer is on {w.device}")

    # ------------------------------------------------------------ inspection
    def plan(self, batch: Optional[int] = None, dtype: Optional[torch.dtype] = None, *,
             device=None, gpu: str = "H200") -> dict:
        """The C planner's choice and cost model for ``batch`` rows (default:
        the rows of the last forward call) in ``dtype`` (default: the dtype
        the layer computes in: its own, or autocast's 16-bit dtype for a
        float32 layer under ``torch.autocast("cpu")``), and under ``"route"``
        whether such calls run in comera's kernels or torch's BLAS
        (:mod:`comera.ops.route`).  ``"kernel"`` names the CPU micro-kernel
        variant that runs the products in this process (``generic``,
        ``avx2``, ``avx512``, ``amx``: AMX tiles for bfloat16, or
        ``avx512bf16``: VDPBF16PS tiles for bfloat16) and
        ``"seconds"`` the planner's predicted time of one forward + backward
        on it with ``"threads"`` threads.

        For ``device="cuda"`` (default: the layer's device) it is instead the
        GPU cost model of :func:`comera.ops.gpu_cost.tt_linear_gpu_plan` on
        ``gpu`` (``"H100"`` or ``"H200"``): FLOPs, bytes, launches and
        predicted seconds of every CUDA launch of one forward + backward,
        with ``torch.nn.Linear``'s beside it (``"dense"``, ``"x_vs_dense"``).

        Example:
            >>> import comera, torch
            >>> comera.TTLinear(768, 3072, rank=30).plan(4096)["path"]
            'merge'
            >>> p = comera.TTLinear(768, 3072, rank=32).plan(4096, torch.bfloat16, device="cuda")
            >>> p["gpu"], p["forward"]["launches"]
            ('NVIDIA H200 SXM', {'kernel': 4, 'blas': 2, 'copy': 1})
        """
        batch = self._prepared.rows if batch is None else _plan_rows(batch)
        if torch.device(self.cores[0].device if device is None else device).type == "cuda":
            if dtype is None:
                dtype = self.cores[0].dtype
                if dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
                    dtype = torch.get_autocast_dtype("cuda")
            return tt_linear_gpu_plan(self.in_shape, self.out_shape, [1] + self.ranks + [1],
                                      self.in_features, self.out_features, batch, dtype,
                                      bias=self.bias is not None, gpu=gpu)
        if dtype is None:
            dtype = self.cores[0].dtype
            if (dtype == torch.float32 and torch.is_autocast_enabled("cpu")
                    and torch.get_autocast_dtype("cpu") in _HALF):
                dtype = torch.get_autocast_dtype("cpu")
        out = tt_linear_plan(self.in_shape, self.out_shape, [1] + self.ranks + [1],
                             self.in_features, self.out_features, batch, dtype)
        if dtype in _HALF:  # the 16-bit kernels have the merge path only
            out["route"] = {"choice": "comera", "why": f"{out['dtype']} runs comera's kernels"}
        elif self.path != "auto":
            out["path"] = self.path
            out["route"] = {"choice": "comera", "why": f"path={self.path!r}"}
        elif out["path"] != "merge":
            out["route"] = {"choice": "comera", "why": "the planner chose the sequential path"}
        else:
            out["route"] = route.describe(list(self.cores), self.bias is not None,
                                          self.num_in_cores, self.in_features,
                                          self.out_features, batch)
        return out

    def _dense_wt(self) -> torch.Tensor:
        p = self.num_in_cores
        cores, gates = list(self.cores), list(self.gates)
        dtype = cores[0].dtype
        if dtype in _HALF:  # float32 math, as in forward
            cores, gates = [c.float() for c in cores], [g.float() for g in gates]
        return dense_wt(cores, gates, p, self.in_features, self.out_features).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The reconstructed dense weight, ``(out_features, in_features)``
        (differentiable; for bfloat16/float16 layers computed in float32 and
        rounded once to the layer's dtype)."""
        return self._dense_wt().t()

    def to_dense(self) -> nn.Linear:
        """An equivalent :class:`torch.nn.Linear`.

        Example:
            >>> import torch, comera
            >>> tt = comera.TTLinear(12, 6, rank=3)
            >>> x = torch.randn(2, 12)
            >>> torch.allclose(tt.to_dense()(x), tt(x), atol=1e-5)
            True
        """
        w = self.cores[0]
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    @classmethod
    def from_dense(cls, linear_or_weight: Union[nn.Linear, torch.Tensor], rank=8, *,
                   bias: Optional[torch.Tensor] = None, in_shape=None, out_shape=None,
                   path: str = "auto") -> "TTLinear":
        """A TTLinear whose weight is the TT-SVD of a dense one, truncated to ``rank``.

        Example:
            >>> import torch, comera
            >>> lin = torch.nn.Linear(16, 8)
            >>> tt = comera.TTLinear.from_dense(lin, rank=64)   # full rank: exact
            >>> torch.allclose(tt.weight, lin.weight, atol=1e-5)
            True
        """
        weight, dtype = tt.dense_source(linear_or_weight, (nn.Linear,), "(out_features, in_features)")
        if isinstance(linear_or_weight, nn.Linear) and bias is None:
            bias = linear_or_weight.bias
        out_f, in_f = weight.shape
        layer = cls(in_f, out_f, bias=bias is not None, rank=rank, in_shape=in_shape,
                    out_shape=out_shape, path=path, device=weight.device, dtype=dtype)
        layer.load_dense_(weight, bias)
        return layer

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "TTLinear":
        """Overwrites cores (TT-SVD of ``weight``) and bias in place; ranks may shrink."""
        dims = self.in_shape + self.out_shape
        wt = torch.zeros(math.prod(self.in_shape), math.prod(self.out_shape),
                         dtype=torch.float64, device=weight.device)
        wt[: self.in_features, : self.out_features] = weight.detach().t().to(torch.float64)
        new = tt.tt_svd(wt, dims, self.ranks)
        for p, c in zip(self.cores, new):
            p.data = c.to(p.dtype)
        for g, c in zip(self.gates, new[:-1]):
            g.data = torch.ones(c.shape[-1], dtype=g.dtype, device=g.device)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias.detach().to(self.bias.dtype))
        self.clear_prepared()
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, in_shape={self.in_shape}, out_shape={self.out_shape}, "
                f"ranks={self.ranks}, params={self.tt_params()}, "
                f"compression={self.compression():.1f}x")
