"""One optimizer step of masked-language-model training, however it is
spread: over processes (DistributedDataParallel, or FSDP2 with ``--fsdp``),
over micro-batches (``--grad-accum``), in bfloat16 autocast (``--precision
bf16``) and through ``torch.compile`` (``--compile``).

Every split computes the gradient of the same quantity, the summed
cross-entropy of the whole global batch divided by its number of predicted
tokens, so 1 process, N processes and N micro-batches train the same model
(up to rounding).
"""
import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from comera.integrations.ddp import all_ranks, rewrap
from comera.layers.base import tt_layers
from comera.pretrain.processes import Context, split_batch

PRECISIONS = ("fp32", "bf16")


class MLMObjective(nn.Module):
    """The summed MLM cross-entropy of a batch as one module, so that
    DistributedDataParallel sees the whole forward.  The
    output layer only runs on the masked positions: the same loss as scoring
    every position and ignoring the rest, at a fraction of the cost.

    Example:
        >>> from comera.pretrain.model import build_dense, preset
        >>> p = preset("tiny"); p.layers, p.hidden, p.ffn, p.seq_len = 1, 32, 64, 16
        >>> obj = MLMObjective(build_dense(p, vocab_size=300, seed=0))
        >>> x = torch.randint(5, 300, (2, 16)); y = torch.full_like(x, -100); y[:, 3] = x[:, 3]
        >>> loss = obj(x, y)
        >>> loss.shape, bool(loss > 0)
        (torch.Size([]), True)
    """

    def __init__(self, model: nn.Module, compile: bool = False):
        super().__init__()
        self.model = model
        # Only the encoder is compiled: the masked positions that the output
        # layer scores vary in number from batch to batch (a graph break).
        # Kept out of the module tree, so parameters are not listed twice.
        object.__setattr__(self, "_encoder", torch.compile(model.roberta) if compile else model.roberta)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self._encoder(input_ids=inputs).last_hidden_state
        chosen = labels != -100
        logits = self.model.lm_head(hidden[chosen])
        return F.cross_entropy(logits.float(), labels[chosen], reduction="sum")

    def fixed(self, inputs: torch.Tensor, index: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the scored positions given in fixed-size
        tensors (:func:`pack_masked`): ``index``, flat positions into
        ``inputs``; ``targets``, their labels, -100 on the padding (ignored).
        The same value as ``forward(inputs, labels)``, and no shape depends on
        the data, so a CUDA graph can hold it."""
        hidden = self._encoder(input_ids=inputs).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        return F.cross_entropy(self.model.lm_head(picked).float(), targets, reduction="sum")


def pack_masked(labels: torch.Tensor, capacity: int):
    """The masked positions of each micro-batch of ``labels`` (``parts`` x
    rows x seq_len, on the host) as fixed-size tensors for
    :meth:`MLMObjective.fixed`: ``(index, targets)``, both ``parts`` x
    ``capacity``, padded with position 0 and target -100.  Raises if a
    micro-batch has more than ``capacity`` masked positions.

    Example:
        >>> labels = torch.tensor([[[-100, 7, -100], [5, -100, -100]]])
        >>> index, targets = pack_masked(labels, 4)
        >>> index.tolist(), targets.tolist()
        ([[1, 3, 0, 0]], [[7, 5, -100, -100]])
    """
    flat = labels.reshape(labels.shape[0], -1)
    index = torch.zeros(flat.shape[0], capacity, dtype=torch.int64)
    targets = torch.full((flat.shape[0], capacity), -100, dtype=torch.int64)
    for part, row in enumerate(flat):
        where = (row != -100).nonzero().squeeze(1)
        if where.numel() > capacity:
            raise ValueError(f"pack_masked: a micro-batch has {where.numel()} masked positions, "
                             f"more than capacity={capacity}")
        index[part, :where.numel()] = where
        targets[part, :where.numel()] = row[where]
    return index, targets


def shard(objective: MLMObjective) -> MLMObjective:
    """FSDP2 over the processes of the run: every TT layer is its own unit
    (``fully_shard``), then the whole objective, the root, which runs the
    encoder and the output layer.  A TT layer that shares a parameter with a
    module outside it (the output decoder's bias is also ``lm_head.bias``)
    stays in the root's unit, as FSDP requires.  Returns ``objective``
    (sharded in place)."""
    holders = {}
    for name, module in objective.named_modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(name)
    for name, layer in tt_layers(objective):
        inside = {n for n, _ in layer.named_modules(prefix=name)}
        if all(holders[id(p)] <= inside for p in layer.parameters()):
            fully_shard(layer)
    fully_shard(objective)
    return objective


def autocast(device: torch.device, precision: str, cache: bool = True):
    """The autocast context of ``precision``: bfloat16 activations with
    float32 parameters for ``"bf16"``, nothing for ``"fp32"``.  ``cache``:
    autocast's cache of cast weights (off for a step captured in a CUDA
    graph, whose replays must cast the updated weights again).

    Example:
        >>> with autocast(torch.device("cpu"), "bf16"):
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16",
                          cache_enabled=cache)


def _shapes(model: nn.Module) -> List[tuple]:
    return [tuple(p.shape) for p in model.parameters()]


class Stepper:
    """Runs training steps of ``model`` with ``optimizer`` in this process's
    share of the run (``ctx``).  Build it before attaching a RankAdaptive to
    the optimizer: under DDP it adds a post-step hook, run before the
    controller's, that copies process 0's gates to every process, so the
    controller decides the same ranks everywhere; after a step that pruned,
    it checks that the processes agree and wraps the pruned module anew.

    Example:
        >>> from comera.pretrain.model import build_dense, preset
        >>> from comera.pretrain.loop import make_optimizer
        >>> p = preset("tiny"); p.layers, p.hidden, p.ffn, p.seq_len = 1, 32, 64, 16
        >>> model = build_dense(p, vocab_size=300, seed=0)
        >>> stepper = Stepper(model, make_optimizer(model, p), device=torch.device("cpu"), grad_accum=2)
        >>> x = torch.randint(5, 300, (4, 16)); y = torch.where(torch.rand(4, 16) < 0.3, x, -100)
        >>> 4.0 < stepper.step(x, y) < 8.0   # about log(300) per token at the start
        True
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 ctx: Optional[Context] = None, precision: str = "fp32", grad_accum: int = 1,
                 compile: bool = False, clip: Optional[float] = None,
                 objective: Optional[MLMObjective] = None):
        autocast(device, precision)  # validates precision
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"--grad-accum must be an integer >= 1, got {grad_accum!r}")
        self.model, self.optimizer, self.device = model, optimizer, device
        self.ctx = ctx if ctx is not None else Context(device=device)
        self.precision, self.grad_accum, self.compile, self.clip = precision, grad_accum, compile, clip
        # a sharded objective (FSDP2, :func:`shard`) comes ready-made
        self.objective = objective if objective is not None else MLMObjective(model, compile=compile)
        self.fsdp = isinstance(self.objective, FSDPModule)
        self.ddp = None
        self._hook = None
        if self.ctx.enabled and not self.fsdp:
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.objective, device_ids=ids)
            self._hook = optimizer.register_step_post_hook(self._sync_gates)
        self.forward = self.ddp if self.ddp is not None else self.objective
        self._shapes = _shapes(model)

    @torch.no_grad()
    def _sync_gates(self, *_):
        gates = [g for _, layer in tt_layers(self.model) for g in layer.gates]
        if not gates:
            return
        # One broadcast for all the gates: they are small, the calls are not.
        flat = torch.cat([g.detach().reshape(-1) for g in gates])
        torch.distributed.broadcast(flat, src=0)
        offset = 0
        for g in gates:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _after_prune(self) -> None:
        """Pruning (inside the controller's hook) changed parameter shapes."""
        self._shapes = _shapes(self.model)
        if self.fsdp:  # comera.integrations.fsdp.prune renewed FSDP's records
            self.ctx.agree(all_ranks(self.model), "the TT ranks after pruning")
            return
        if self.ddp is None:
            return  # a compiled encoder recompiles for the new shapes by itself
        self.ctx.agree(all_ranks(self.model), "the TT ranks after pruning")
        self.forward = self.ddp = rewrap(self.ddp)

    def _my_rows(self, inputs: torch.Tensor, labels: torch.Tensor):
        rows = inputs.shape[0] // self.ctx.world
        mine = slice(self.ctx.rank * rows, (self.ctx.rank + 1) * rows)
        return inputs[mine].to(self.device), labels[mine].to(self.device)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on the global batch ``(inputs, labels)`` (every
        process passes the whole batch and trains on its share); returns the
        mean loss per predicted token over the global batch."""
        split_batch(inputs.shape[0], self.ctx.world, self.grad_accum)
        count = int((labels != -100).sum())
        inputs, labels = self._my_rows(inputs, labels)
        micro = inputs.shape[0] // self.grad_accum
        # DDP averages the gradients over the processes: scaling each share by
        # world / count makes the sum that of the whole batch over its tokens.
        scale = count / self.ctx.world
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(self.grad_accum):
            last = i == self.grad_accum - 1
            part = slice(i * micro, (i + 1) * micro)
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            if self.fsdp:  # reduce-scatter the gradients after the last micro-batch only
                self.objective.set_requires_gradient_sync(last)
            with sync:
                with autocast(self.device, self.precision):
                    loss_sum = self.forward(inputs[part], labels[part])
                (loss_sum / scale).backward()
            total += loss_sum.detach().double()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()        # an attached controller runs its stage step here
        self.optimizer.zero_grad(set_to_none=True)
        if _shapes(self.model) != self._shapes:
            self._after_prune()
        return float(self.ctx.sum(total)) / count

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


@torch.no_grad()
def evaluate(model: nn.Module, data, device: torch.device, batch_size: int, *,
             ctx: Optional[Context] = None, precision: str = "fp32",
             objective: Optional[MLMObjective] = None) -> float:
    """Mean validation MLM loss per predicted token (fixed masks); the
    processes of ``ctx`` score every ``world``-th batch each and add up.
    A sharded ``objective`` (FSDP2) needs every process in every forward:
    then each process scores every batch (the same result, computed alike)."""
    ctx = ctx if ctx is not None else Context(device=device)
    was_training = model.training
    model.eval()
    sharded = isinstance(objective, FSDPModule)
    objective = objective if objective is not None else MLMObjective(model)
    sums = torch.zeros(2, dtype=torch.float64)
    for i, (inputs, labels) in enumerate(data.valid_batches(batch_size)):
        if i % ctx.world != ctx.rank and not sharded:
            continue
        with autocast(device, precision):
            loss = objective(inputs.to(device), labels.to(device))
        sums[0] += float(loss)
        sums[1] += int((labels != -100).sum())
    model.train(was_training)
    total, count = (sums if sharded else ctx.sum(sums)).tolist()
    return total / max(1.0, count)
