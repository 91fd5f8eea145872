"""The training loop of one method (dense or CoMERA): AdamW with warm-up
and linear decay, gradient clipping, periodic evaluation and checkpoints,
clean stops (Ctrl-C, a time budget) and exact resumption."""
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch import nn

from comera import storage
from comera.adapt import RankAdaptive, prune
from comera.integrations import fsdp as fsdp_glue
from comera.pretrain.data import MLMData
from comera.pretrain.graphed import GraphedStepper
from comera.pretrain.model import Preset, build_comera, build_dense, count_parameters
from comera.pretrain.monitor import PeakMemory, Progress, StopFlag, release_memory
from comera.pretrain.processes import Context
from comera.pretrain.step import MLMObjective, Stepper, evaluate, shard  # noqa: F401 - evaluate: this module's API

METHODS = ("dense", "comera")


def mlm_loss_sum(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    """(summed cross-entropy, number of predicted tokens) of a batch: see
    :class:`comera.pretrain.step.MLMObjective`."""
    return MLMObjective(model)(inputs, labels), int((labels != -100).sum())


def method_lr(method: str, p: Preset) -> float:
    """The peak learning rate of a method: TT layers train best with a larger
    one than dense layers (``--lr-comera``)."""
    return p.lr_comera if method == "comera" and p.lr_comera is not None else p.lr


def make_optimizer(model: nn.Module, p: Preset, lr: Optional[float] = None) -> torch.optim.Optimizer:
    """AdamW with peak ``lr`` (default ``p.lr``); biases, LayerNorm weights
    and TT gates are not decayed (the gates have their own L1 penalty)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.dim() < 2 or ".gates." in name:
            no_decay.append(param)
        else:
            decay.append(param)
    return torch.optim.AdamW([{"params": decay, "weight_decay": p.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=p.lr if lr is None else lr, betas=(0.9, 0.98), eps=1e-6)


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Readies ``optimizer`` for a step captured in a graph: each group's
    learning rate becomes a tensor on ``device`` (the schedule fills it in
    place) and, on CUDA, AdamW runs ``capturable`` (its step counts on the
    device).  Call it after loading a state dict, which brings floats back.

    Example:
        >>> opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=0.5)
        >>> make_capturable(opt, torch.device("cpu")); opt.param_groups[0]["lr"]
        tensor(0.5000)
    """
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        if device.type == "cuda":
            group["capturable"] = True
    for state in optimizer.state.values() if device.type == "cuda" else ():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].to(device=device, dtype=torch.float32)


def portable_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with plain float learning rates and
    ``capturable`` off, so that a checkpoint of a captured run resumes
    anywhere (:func:`make_capturable` redoes it)."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False
    return state


def make_schedule(optimizer, p: Preset):
    """Linear warm-up over ``warmup * steps`` steps, then linear decay to 0.

    Example:
        >>> from comera.pretrain.model import preset
        >>> p = preset("tiny"); p.steps, p.warmup, p.lr = 5, 0.4, 1.0
        >>> opt = make_optimizer(nn.Linear(2, 2), p)
        >>> sched, lrs = make_schedule(opt, p), []
        >>> for _ in range(5):
        ...     lrs.append(round(sched.get_last_lr()[0], 3)); opt.step(); sched.step()
        >>> lrs
        [0.5, 1.0, 1.0, 0.667, 0.333]
    """
    warm = max(1, round(p.warmup * p.steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (p.steps - step) / max(1, p.steps - warm))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_controller(model: nn.Module, p: Preset, pruner=None):
    """The preset's RankAdaptive for ``model`` (``pruner``: see RankAdaptive;
    comera.integrations.fsdp.prune for a sharded model)."""
    return RankAdaptive(model, gamma=p.gamma, threshold=p.threshold,
                        stage1_steps=int(p.stage1 * p.steps), stage2_steps=int(p.stage2 * p.steps),
                        target_compression=p.target_compression, prune_every=p.prune_every,
                        stage2_rule=p.stage2_rule, pruner=pruner)


def stage_name(controller) -> str:
    """"dense", or the rank controller's stage: "1", "2", "2 frozen"."""
    if controller is None:
        return "dense"
    return f"{controller.stage}{' frozen' if getattr(controller, 'frozen', False) else ''}"


def _new_history() -> dict:
    return {"step": [], "loss": [], "lr": [], "valid": [], "tokens_per_s": [], "compression": [],
            "whole_compression": [], "stage": [], "ranks": {"step": [], "layers": {}}}


def _record_structure(history: dict, model: nn.Module, step: int, controller) -> tuple:
    counts = count_parameters(model)
    conv = counts["converted_dense"] / counts["converted_tt"] if counts["converted_tt"] else 1.0
    whole = counts["dense_equivalent"] / counts["total_live"]
    history["compression"].append([step, conv])
    history["whole_compression"].append([step, whole])
    history["stage"].append([step, stage_name(controller)])
    ranks = storage.tt_live_ranks(model)
    if ranks:
        history["ranks"]["step"].append(step)
        for name, r in ranks.items():
            history["ranks"]["layers"].setdefault(name, []).append(r)
    return conv, whole


class Budget:
    """When to stop early: a wall-clock deadline and/or a step count for
    this invocation."""

    def __init__(self, deadline: Optional[float] = None, stop_after: Optional[int] = None):
        self.deadline, self.stop_after = deadline, stop_after


@dataclass
class Options:
    """How each step is computed: the processes (``ctx``), ``precision``
    (``"fp32"`` or ``"bf16"`` autocast), ``grad_accum`` micro-batches per
    step, ``compile`` (torch.compile of the forward), ``fsdp`` (FSDP2
    sharding over the processes instead of DistributedDataParallel) and
    ``graph`` (each step one captured CUDA graph,
    :mod:`comera.pretrain.graphed`; None: on for one process on CUDA)."""
    ctx: Optional[Context] = None
    precision: str = "fp32"
    grad_accum: int = 1
    compile: bool = False
    fsdp: bool = False
    graph: Optional[bool] = None

    def graphed(self, device: torch.device) -> bool:
        """Whether steps on ``device`` run as captured graphs."""
        several = self.ctx is not None and self.ctx.enabled
        if self.graph is None:
            return device.type == "cuda" and not several and not self.fsdp
        if self.graph and (several or self.fsdp):
            raise ValueError("--graph captures the step of one process: it does not combine with "
                             "several processes or --fsdp")
        if self.graph and device.type != "cuda":
            raise ValueError(f"--graph captures CUDA graphs: it needs a CUDA --device, got {device}")
        return self.graph


def _new_totals() -> dict:
    return {"train_time_s": 0.0, "wall_time_s": 0.0, "tokens": 0, "peak_memory_bytes": 0,
            "peak_memory_growth_bytes": 0}


def _resume(path, model, optimizer, schedule, controller, ctx: Context, log,
            root: Optional[nn.Module] = None) -> tuple:
    """(step, history, totals) from the checkpoint at ``path``, or a fresh
    start; every process must find the same checkpoint.  ``root``: the FSDP2
    root around a sharded ``model`` (the checkpoint holds whole tensors)."""
    state = storage.load_training_state(path) if os.path.exists(path) else None
    step = state["step"] if state is not None else 0
    if ctx.max(step) != step or ctx.max(-step) != -step:
        raise ValueError(f"--resume: the processes found different checkpoints at {path!r} (this one: "
                         f"{'step ' + str(step) if state else 'none'}); with several machines the run "
                         "directory must be on a file system that every machine reads")
    if state is None:
        return 0, _new_history(), _new_totals()
    if root is not None:  # pruned TT layers resize first, in either case
        fsdp_glue.load_full_state_dict(model, state["model"], root=root)
        fsdp_glue.load_full_optimizer_state_dict(optimizer, state["optimizer"])
    else:
        storage.load_state_dict(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    if controller is not None:
        controller.load_state_dict(state["controller"])
    storage.set_rng_state(state["rng"])
    log(f"resumed from {path} at step {step}")
    return step, state["history"], state["totals"]


def _stop_reason(stop: StopFlag, budget: Budget, steps_this_run: int, ctx: Context) -> Optional[str]:
    """Why to stop before the next step, the same in every process (the
    first process to see Ctrl-C or the deadline stops them all)."""
    code = 1 if stop.requested else 2 if budget.deadline is not None and time.time() >= budget.deadline else 0
    code = ctx.max(code)
    if code == 1:
        return stop.reason or "interrupted"
    if code == 2:
        return "time budget (--max-minutes)"
    if budget.stop_after is not None and steps_this_run >= budget.stop_after:
        return "--stop-after"
    return None


class _MethodRun:
    """The state of one method's training in this process: model, optimizer,
    schedule, controller, step and history, and what saves and scores them."""

    def __init__(self, method: str, p: Preset, data: MLMData, run_dir: str, device: torch.device,
                 seed: int, resume: bool, opt: Options, log: Callable):
        self.method, self.p, self.data, self.device, self.opt = method, p, data, device, opt
        self.ctx = ctx = opt.ctx if opt.ctx is not None else Context(device=device)
        mdir = os.path.join(run_dir, method)
        if ctx.main:
            os.makedirs(mdir, exist_ok=True)
        self.path = os.path.join(mdir, "checkpoint.pt")
        self.memory = PeakMemory(device)
        # Measured from before the model exists: it and its optimizer state count.
        self.memory.reset()
        build = build_comera if method == "comera" else build_dense
        self.model = build(p, data.vocab_size, seed).to(device).train()
        # --fsdp: sharded before the optimizer sees the parameters
        self.objective = shard(MLMObjective(self.model)) if opt.fsdp else None
        self.optimizer = make_optimizer(self.model, p, method_lr(method, p))
        self.schedule = make_schedule(self.optimizer, p)
        # The controller balances the TT layers when built (before any optimizer
        # state exists); attached, it runs after every optimizer.step().
        self.controller = make_controller(self.model, p, self._prune if opt.fsdp else None) \
            if method == "comera" else None
        if resume:
            self.step, self.history, self.totals = _resume(
                self.path, self.model, self.optimizer, self.schedule, self.controller, ctx,
                lambda m: log(f"{method}: {m}"), root=self.objective)
        else:
            self.step, self.history, self.totals = 0, _new_history(), _new_totals()
        if self.step == 0:
            torch.manual_seed(seed)
        self.stepper = self._make_stepper(p, opt)
        self.t_start = time.perf_counter()
        self.wall_before = self.totals["wall_time_s"]

    def _make_stepper(self, p: Preset, opt: Options):
        if opt.graphed(self.device):  # the stepper drives the controller around each replay
            make_capturable(self.optimizer, self.device)
            if self.controller is not None:
                self.controller.sync_free = True  # (the CUDA default) its gate step in the graph
            return GraphedStepper(self.model, self.optimizer, device=self.device,
                                  controller=self.controller, precision=opt.precision,
                                  grad_accum=opt.grad_accum, compile=opt.compile, clip=p.clip)
        # Its gate-sync hook (several processes) must run before the controller's.
        stepper = Stepper(self.model, self.optimizer, device=self.device, ctx=self.ctx,
                          precision=opt.precision, grad_accum=opt.grad_accum, compile=opt.compile,
                          clip=p.clip, objective=self.objective)
        if self.controller is not None:
            self.controller.attach(self.optimizer)
        return stepper

    def _prune(self, model: nn.Module, optimizer) -> dict:
        """Pruning of the model sharded inside ``self.objective`` (--fsdp)."""
        return fsdp_glue.prune(model, optimizer, root=self.objective)

    def save_checkpoint(self) -> None:
        totals = self.totals
        totals["wall_time_s"] = self.wall_before + time.perf_counter() - self.t_start
        peak = self.memory.peak()
        totals["peak_memory_bytes"] = max(totals["peak_memory_bytes"], peak)
        totals["peak_memory_growth_bytes"] = max(totals.get("peak_memory_growth_bytes", 0),
                                                 peak - self.memory.baseline)
        if self.opt.fsdp:  # whole tensors, gathered by every process
            model_state = fsdp_glue.full_state_dict(self.model)
            optimizer_state = fsdp_glue.full_optimizer_state_dict(self.optimizer)
        if not self.ctx.main:
            return
        if not self.opt.fsdp:
            model_state, optimizer_state = self.model.state_dict(), portable_state(self.optimizer)
        c = self.controller
        storage.save_training_state(self.path, {
            "method": self.method, "step": self.step, "model": model_state,
            "tt_ranks": storage.tt_shapes(self.model), "optimizer": optimizer_state,
            "schedule": self.schedule.state_dict(), "controller": c.state_dict() if c is not None else None,
            "rng": storage.rng_state(), "history": self.history, "totals": totals,
            "preset": asdict(self.p), "finished": self.step >= self.p.steps})

    def score(self) -> float:
        return evaluate(self.model, self.data, self.device, self.p.batch_size, ctx=self.ctx,
                        precision=self.opt.precision, objective=self.objective)

    def train_step(self) -> float:
        """One step, recorded in the history and totals; returns its loss."""
        t0 = time.perf_counter()
        loss_value = self.stepper.step(*self.data.batch(self.step))
        lr = float(self.schedule.get_last_lr()[0])
        self.schedule.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        self.totals["train_time_s"] += time.perf_counter() - t0
        self.totals["tokens"] += self.p.batch_size * self.p.seq_len  # the global batch
        self.history["step"].append(self.step)
        self.history["loss"].append(loss_value)
        self.history["lr"].append(lr)
        return loss_value

    def tokens_per_s(self) -> float:
        return self.totals["tokens"] / max(self.totals["train_time_s"], 1e-9)

    def close(self) -> None:
        self.stepper.close()
        if self.controller is not None:
            self.controller.detach()


def train_method(method: str, p: Preset, data: MLMData, run_dir: str, *, device: torch.device,
                 seed: int, resume: bool, budget: Budget, stop: StopFlag, progress: bool = True,
                 log: Callable = print, options: Optional[Options] = None) -> dict:
    """Trains ``method`` for ``p.steps`` steps (or until stopped) and returns
    its result: metrics and history, also written to
    ``run_dir/<method>/result.json`` by the caller.  Under several processes
    (``options.ctx``) every process calls it; only the main one writes.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    r = _MethodRun(method, p, data, run_dir, device, seed, resume, options or Options(), log)
    history, controller = r.history, r.controller
    bar = Progress(p.steps, every=p.log_every, enabled=progress and r.ctx.main, prefix=f"{method:>6} ")
    stop_reason = "finished" if r.step >= p.steps else None
    steps_this_run = 0
    conv = history["compression"][-1][1] if history["compression"] else \
        _record_structure(history, r.model, r.step, controller)[0]
    while r.step < p.steps:
        stop_reason = _stop_reason(stop, budget, steps_this_run, r.ctx)
        if stop_reason is not None:
            break
        loss_value = r.train_step()
        steps_this_run += 1
        step = r.step
        if not math.isfinite(loss_value):
            stop_reason = "loss is not finite"
            log(f"{method}: stopping at step {step}: the training loss is {loss_value}")
            break
        if step % p.log_every == 0 or step == p.steps:
            r.memory.sample()
            history["tokens_per_s"].append([step, r.tokens_per_s()])
            conv = _record_structure(history, r.model, step, controller)[0]
        if step % p.eval_every == 0 or step == p.steps:
            history["valid"].append([step, r.score()])
        if step % p.checkpoint_every == 0 and step < p.steps:
            r.save_checkpoint()
        bar.update(step, loss=loss_value, tokens_per_s=r.tokens_per_s(), stage=stage_name(controller),
                   compression=conv)
    bar.close()
    r.stepper.close()
    # Always end on an evaluation of the current weights, for the report.
    if not history["valid"] or history["valid"][-1][0] != r.step:
        history["valid"].append([r.step, r.score()])
    if r.step >= p.steps and controller is not None:
        # Finished: cut dead ranks for good, so the saved model is small (the
        # gates are the same in every process, so are the cuts).
        (r._prune if r.opt.fsdp else prune)(r.model, r.optimizer)
    if not history["compression"] or history["compression"][-1][0] != r.step:
        _record_structure(history, r.model, r.step, controller)
    r.save_checkpoint()
    result = _result(method, r.model, controller, p, r.step, stop_reason or "finished", history,
                     r.totals, r.memory)
    # this invocation's steps: captured in a CUDA graph (--graph) or eager
    result["graph"] = r.stepper.report() if isinstance(r.stepper, GraphedStepper) else None
    r.close()
    del r, controller  # the controller holds the model
    release_memory()
    return result


def _result(method, model, controller, p, step, stop_reason, history, totals, memory) -> dict:
    counts = count_parameters(model)
    summary = None
    if controller is not None:
        import comera
        summary = comera.summary(model) if hasattr(comera, "summary") else None
    return {
        "method": method, "steps_done": step, "steps_planned": p.steps, "stopped": stop_reason,
        "parameters": counts,
        "compression_converted": (counts["converted_dense"] / counts["converted_tt"]
                                  if counts["converted_tt"] else 1.0),
        "compression_whole": counts["dense_equivalent"] / counts["total_live"],
        "valid_loss": history["valid"][-1][1],
        "valid_perplexity": math.exp(min(history["valid"][-1][1], 700.0)),
        "tokens_per_s": totals["tokens"] / max(totals["train_time_s"], 1e-9),
        "train_time_s": totals["train_time_s"], "wall_time_s": totals["wall_time_s"],
        "peak_memory_bytes": totals["peak_memory_bytes"], "peak_memory_kind": memory.kind,
        "peak_memory_growth_bytes": totals["peak_memory_growth_bytes"],
        "final_ranks": storage.tt_live_ranks(model), "summary": summary, "history": history,
    }
