"""Training steps captured in a CUDA graph: what ``comera pretrain`` runs on
one CUDA device (``--graph``, on there by default).

A captured step is the whole optimizer step: the forward and backward of
every micro-batch, gradient clipping, AdamW (``capturable=True``, its
learning rate a device tensor that the schedule fills) and the rank
controller's gate step (:meth:`comera.RankAdaptive.step_gates`, sync-free).
One replay replaces the thousands of launches and the Python of an eager
step.

What changes from step to step is copied into static buffers before each
replay: the token ids, the masked positions of each micro-batch (a fixed
number, the capacity, padded with ignored targets: :func:`pack_masked`) and
the batch's number of predicted tokens.  What the captured work depends on
besides tensor values is the *key*: the batch shape, the capacity, the
parameter shapes and :meth:`comera.RankAdaptive.capture_key` (stage, frozen
schedule, kill rounds).  When it changes (a stage switch, a prune, a batch with more
masked tokens than the capacity) the graph is dropped, that step runs
eagerly (the same fixed-shape computation, on a side stream as capture
requires, which also creates the optimizer state), and the next step
captures anew.  The host part of the controller's step (the step counter,
its copy on the device, pruning) runs around each replay.  While stage 2
may kill ranks with more than ``GRAPH_KILL_ROUNDS`` masked rounds, the gate
step runs after the replay instead, reading the device to stop at the last
kill (the same result: tested).

The graph changes parameters in place without autograd's version counters
seeing it, so after each replay the stepper bumps them: what a layer keeps
per parameter version (a TTLinear's merged factors for small evaluation
calls) is renewed.
"""
import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.autograd.graph import increment_version

from comera.adapt import RankAdaptive
from comera.layers import TTEmbedding
from comera.pretrain.processes import split_batch
from comera.pretrain.step import MLMObjective, autocast, pack_masked

# Masked positions a micro-batch may hold, over the first batch's count:
# MLM masks are random, so a later batch may have a few more.
HEADROOM = 1.1
ROUND = 64  # capacities are multiples of this (aligned products, few re-captures)
# A gate step with more stage-2 kill rounds than this runs after the replay,
# reading the device to stop at the last kill: each round is dozens of small
# kernels, most of them idle, and a step rarely kills more than a few ranks.
GRAPH_KILL_ROUNDS = 16


class CudaGraph:
    """A captured step on one CUDA device (``torch.cuda.CUDAGraph``)."""

    def __init__(self, device: torch.device):
        self.device, self.graph = device, torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None]) -> None:
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(self.graph):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class RerunGraph:
    """Stands in for :class:`CudaGraph` where there is no GPU (tests): capture
    keeps the function, each replay runs it again.  ``host``: what must not
    change on the host while a replay runs (a CUDA graph replays no Python),
    checked around every replay."""

    def __init__(self, host: Callable[[], object] = lambda: None):
        self.fn: Optional[Callable[[], None]] = None
        self.host = host

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        before = self.host()
        self.fn()
        after = self.host()
        if after != before:
            raise RuntimeError(f"a captured step changed host state ({before!r} -> {after!r}); "
                               "a CUDA graph would not")


@dataclass
class _Buffers:
    """The static inputs and output of the captured step."""
    inputs: torch.Tensor   # token ids, rows x seq_len
    index: torch.Tensor    # masked positions per micro-batch, parts x capacity
    targets: torch.Tensor  # their labels (-100: padding), parts x capacity
    count: torch.Tensor    # predicted tokens of the batch (float32, 0-d)
    loss: torch.Tensor     # the summed loss of the step (float64, 0-d)


def check_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Raises unless every parameter group's learning rate is a tensor on
    ``device`` (a float would be frozen into the graph at its capture-time
    value) and, on CUDA, the optimizer is ``capturable``."""
    for i, group in enumerate(optimizer.param_groups):
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device != device:
            raise ValueError(f"a captured step needs each param group's lr as a tensor on {device} "
                             f"(group {i} has {type(lr).__name__}"
                             f"{'' if not isinstance(lr, torch.Tensor) else ' on ' + str(lr.device)})")
        if device.type == "cuda" and not group.get("capturable", False):
            raise ValueError(f"a captured step needs a capturable optimizer (group {i} has "
                             "capturable=False): build it with capturable=True")


class GraphedStepper:
    """Runs MLM training steps of ``model`` as one captured step each (module
    doc); the interface of :class:`comera.pretrain.step.Stepper` for one
    process.  ``controller``: a :class:`comera.RankAdaptive` that is *not*
    attached to ``optimizer``: the stepper runs its three parts.  The
    model's TT embeddings are switched to ``capturable`` (the stepper checks
    the token ids on the host instead).  ``graph``:
    makes an object with ``capture(fn)`` and ``replay()`` (default: a
    :class:`CudaGraph` on ``device``).

    Example (on the CPU with :class:`RerunGraph`, as the tests run it):
        >>> from comera.pretrain.model import build_dense, preset
        >>> p = preset("tiny"); p.layers, p.hidden, p.ffn, p.seq_len = 1, 32, 64, 16
        >>> model = build_dense(p, vocab_size=300, seed=0)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        >>> stepper = GraphedStepper(model, opt, device=torch.device("cpu"), graph=RerunGraph)
        >>> x = torch.randint(5, 300, (4, 16)); y = torch.where(torch.rand(4, 16) < 0.3, x, -100)
        >>> losses = [stepper.step(x, y) for _ in range(3)]
        >>> stepper.captures, 4.0 < losses[-1] < 8.0
        (1, True)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 controller: Optional[RankAdaptive] = None, precision: str = "fp32",
                 grad_accum: int = 1, compile: bool = False, clip: Optional[float] = None,
                 graph: Optional[Callable[[], object]] = None):
        autocast(device, precision)  # validates precision
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"--grad-accum must be an integer >= 1, got {grad_accum!r}")
        if graph is None and device.type != "cuda":
            raise ValueError(f"--graph captures CUDA graphs: it needs a CUDA device, got {device}")
        check_capturable(optimizer, device)
        if controller is not None and not controller.uses_sync_free():
            raise ValueError("a captured step needs a sync-free RankAdaptive (sync_free=None on "
                             "CUDA, or True)")
        self.model, self.optimizer, self.device, self.controller = model, optimizer, device, controller
        self.precision, self.grad_accum, self.clip = precision, grad_accum, clip
        self.objective = MLMObjective(model, compile=compile)
        # TT embeddings skip their device-side index check (a host sync);
        # the ids are checked here, on the host, before each step
        for m in model.modules():
            if isinstance(m, TTEmbedding):
                m.capturable = True
        table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self._vocab = getattr(table, "num_embeddings", None)
        self._make_graph = graph if graph is not None else (lambda: CudaGraph(device))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._graph, self._key, self._buf = None, None, None
        self._gates_inside = False  # the gate step is part of the captured step
        self.capacity = 0
        self.captures = 0  # graphs captured so far
        self.eager_steps = 0  # steps run without a graph (the first after each key change)
        self.failed: Optional[str] = None  # why a capture failed (then every step is eager)

    # ----------------------------------------------------------- one step
    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on ``(inputs, labels)`` (host tensors); returns
        the mean loss per predicted token."""
        split_batch(inputs.shape[0], 1, self.grad_accum)
        count = int((labels != -100).sum())
        if self._vocab is not None and inputs.numel() and (
                int(inputs.min()) < 0 or int(inputs.max()) >= self._vocab):
            raise ValueError(f"token ids must lie in [0, {self._vocab}), got "
                             f"[{int(inputs.min())}, {int(inputs.max())}]")
        if count == 0:
            raise ValueError("the batch has no predicted tokens (every label is -100)")
        parts = labels.reshape(self.grad_accum, -1, labels.shape[-1])
        need = int((parts != -100).flatten(1).sum(1).max())
        if need > self.capacity:
            self.capacity = -(-int(need * HEADROOM) // ROUND) * ROUND
        key = (tuple(inputs.shape), self.capacity, self._shapes(),
               self.controller.capture_key() if self.controller is not None else None)
        changed = key != self._key
        if changed:
            self._drop_graph()
            self._buf = self._new_buffers(inputs.shape)
            self._gates_inside = (self.controller is not None
                                  and self.controller.kill_rounds() <= GRAPH_KILL_ROUNDS)
        self._fill(inputs, parts, count)
        if self.controller is not None:
            self.controller.step_begin()
        if changed or self.failed is not None:  # eagerly; capture at the next
            self._key = key
            self._eager()
        elif self._graph is None and not self._capture():
            self._eager()
        else:
            self._graph.replay()
            increment_version(list(self.model.parameters()))
        if self.controller is not None and not self._gates_inside:
            self.controller.step_gates(self.optimizer, sync=True)
        loss = float(self._buf.loss) / count
        if self.controller is not None:
            self.controller.step_end(self.optimizer)
        return loss

    def _compute(self) -> None:
        """The whole step on the static buffers (captured, or run eagerly)."""
        buf, micro = self._buf, self._buf.inputs.shape[0] // self.grad_accum
        # Python only: the first backward then writes the gradients rather
        # than adding to them, as in every replay of a graph captured so
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for i in range(self.grad_accum):
            with autocast(self.device, self.precision, cache=False):
                loss_sum = self.objective.fixed(buf.inputs[i * micro:(i + 1) * micro],
                                                buf.index[i], buf.targets[i])
            (loss_sum / buf.count).backward()
            part = loss_sum.detach().double()
            total = part if total is None else total + part
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        if self._gates_inside:
            self.controller.step_gates(self.optimizer)
        buf.loss.copy_(total)

    def _eager(self) -> None:
        self.eager_steps += 1
        with self._side_stream(), warnings.catch_warnings():
            # AdamW warns when a capturable instance steps outside a capture:
            # these steps do so by design, between captures
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable")
            self._compute()

    def _capture(self) -> bool:
        """Captures the step; on failure warns, and every later step runs
        eagerly (the same computation, so the run goes on unchanged)."""
        self.optimizer.zero_grad(set_to_none=True)  # backward then allocates the graph's own
        try:
            graph = self._make_graph()
            graph.capture(self._compute)
        except Exception as e:  # noqa: BLE001 - any capture failure has the same remedy
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"comera pretrain: capturing the training step in a CUDA graph failed "
                          f"({self.failed}); the run goes on with eager steps (--no-graph "
                          "avoids the attempt)", stacklevel=3)
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return False
        self._graph = graph
        self.captures += 1
        return True

    def report(self) -> dict:
        """How the steps ran: captures, eager steps, and a capture failure if any."""
        return {"captures": self.captures, "eager_steps": self.eager_steps, "failed": self.failed}

    # ------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _side_stream(self):
        """Runs the block on the side stream (on CUDA), then makes the
        device's current stream wait for it."""
        if self._stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def _drop_graph(self) -> None:
        if self._graph is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the graph's own gradients go with it
            self._graph = None

    def _shapes(self) -> tuple:
        return tuple(tuple(p.shape) for p in self.model.parameters())

    def _new_buffers(self, shape: torch.Size) -> _Buffers:
        on = dict(device=self.device)
        return _Buffers(inputs=torch.zeros(shape, dtype=torch.int64, **on),
                        index=torch.zeros(self.grad_accum, self.capacity, dtype=torch.int64, **on),
                        targets=torch.zeros(self.grad_accum, self.capacity, dtype=torch.int64, **on),
                        count=torch.zeros((), dtype=torch.float32, **on),
                        loss=torch.zeros((), dtype=torch.float64, **on))

    def _fill(self, inputs: torch.Tensor, parts: torch.Tensor, count: int) -> None:
        """Copies the batch into the buffers (``parts``: the labels per micro-batch)."""
        index, targets = pack_masked(parts, self.capacity)
        self._buf.inputs.copy_(inputs)
        self._buf.index.copy_(index)
        self._buf.targets.copy_(targets)
        self._buf.count.fill_(float(count))

    def close(self) -> None:
        """Drops the graph (and the gradients it owns)."""
        self._drop_graph()

