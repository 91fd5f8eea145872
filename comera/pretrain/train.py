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

from comera import persistence
from comera.pretrain.data import MLMData
from comera.pretrain.model import Preset, build_comera, build_dense, count_parameters
from comera.pretrain.monitor import PeakMemory, Progress, StopFlag, release_memory
from comera.pretrain.distributed import Context
from comera.pretrain.step import MLMObjective, Stepper, evaluate  # noqa: F401 - evaluate: this module's API

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


def make_controller(model: nn.Module, p: Preset):
    import comera
    if not hasattr(comera, "RankAdaptive"):
        raise RuntimeError("--method comera needs comera.RankAdaptive, which this build of comera lacks")
    return comera.RankAdaptive(model, gamma=p.gamma, threshold=p.threshold,
                               stage1_steps=int(p.stage1 * p.steps), stage2_steps=int(p.stage2 * p.steps),
                               target_compression=p.target_compression, prune_every=p.prune_every,
                               stage2_rule=p.stage2_rule)


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
    ranks = persistence.tt_live_ranks(model)
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
    step, and ``compile`` (torch.compile of the forward)."""
    ctx: Optional[Context] = None
    precision: str = "fp32"
    grad_accum: int = 1
    compile: bool = False


def _new_totals() -> dict:
    return {"train_time_s": 0.0, "wall_time_s": 0.0, "tokens": 0, "peak_memory_bytes": 0,
            "peak_memory_growth_bytes": 0}


def _resume(path, model, optimizer, schedule, controller, ctx: Context, log) -> tuple:
    """(step, history, totals) from the checkpoint at ``path``, or a fresh
    start; every process must find the same checkpoint."""
    state = persistence.load_training_state(path) if os.path.exists(path) else None
    step = state["step"] if state is not None else 0
    if ctx.max(step) != step or ctx.max(-step) != -step:
        raise ValueError(f"--resume: the processes found different checkpoints at {path!r} (this one: "
                         f"{'step ' + str(step) if state else 'none'}); with several machines the run "
                         "directory must be on a file system that every machine reads")
    if state is None:
        return 0, _new_history(), _new_totals()
    persistence.load_state_dict(model, state["model"])  # pruned TT layers resize first
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    if controller is not None:
        controller.load_state_dict(state["controller"])
    persistence.set_rng_state(state["rng"])
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
    opt = options if options is not None else Options()
    ctx = opt.ctx if opt.ctx is not None else Context(device=device)
    mdir = os.path.join(run_dir, method)
    if ctx.main:
        os.makedirs(mdir, exist_ok=True)
    path = os.path.join(mdir, "checkpoint.pt")
    memory = PeakMemory(device)
    # Measured from before the model exists: it and its optimizer state count.
    memory.reset()
    build = build_comera if method == "comera" else build_dense
    model = build(p, data.vocab_size, seed).to(device).train()
    optimizer = make_optimizer(model, p, method_lr(method, p))
    schedule = make_schedule(optimizer, p)
    # The controller balances the TT layers when built (before any optimizer
    # state exists); attached, it runs after every optimizer.step().
    controller = make_controller(model, p) if method == "comera" else None
    if resume:
        step, history, totals = _resume(path, model, optimizer, schedule, controller, ctx,
                                        lambda m: log(f"{method}: {m}"))
    else:
        step, history, totals = 0, _new_history(), _new_totals()
    if step == 0:
        torch.manual_seed(seed)
    # Its gate-sync hook (several processes) must run before the controller's.
    stepper = Stepper(model, optimizer, device=device, ctx=ctx, precision=opt.precision,
                      grad_accum=opt.grad_accum, compile=opt.compile, clip=p.clip)
    if controller is not None:
        controller.attach(optimizer)
    t_start = time.perf_counter()
    wall_before = totals["wall_time_s"]

    def save_checkpoint():
        totals["wall_time_s"] = wall_before + time.perf_counter() - t_start
        peak = memory.peak()
        totals["peak_memory_bytes"] = max(totals["peak_memory_bytes"], peak)
        totals["peak_memory_growth_bytes"] = max(totals.get("peak_memory_growth_bytes", 0),
                                                 peak - memory.baseline)
        if not ctx.main:
            return
        persistence.save_training_state(path, {
            "method": method, "step": step, "model": model.state_dict(),
            "tt_ranks": persistence.tt_shapes(model), "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "controller": controller.state_dict() if controller is not None else None,
            "rng": persistence.rng_state(), "history": history, "totals": totals,
            "preset": asdict(p), "finished": step >= p.steps})

    def score():
        return evaluate(model, data, device, p.batch_size, ctx=ctx, precision=opt.precision)

    bar = Progress(p.steps, every=p.log_every, enabled=progress and ctx.main, prefix=f"{method:>6} ")
    tokens_per_step = p.batch_size * p.seq_len
    stop_reason = "finished" if step >= p.steps else None
    steps_this_run = 0
    conv, whole = (history["compression"][-1][1], history["whole_compression"][-1][1]) \
        if history["compression"] else _record_structure(history, model, step, controller)
    while step < p.steps:
        stop_reason = _stop_reason(stop, budget, steps_this_run, ctx)
        if stop_reason is not None:
            break
        t0 = time.perf_counter()
        loss_value = stepper.step(*data.batch(step))
        lr = schedule.get_last_lr()[0]
        schedule.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step += 1
        steps_this_run += 1
        totals["train_time_s"] += dt
        totals["tokens"] += tokens_per_step
        history["step"].append(step)
        history["loss"].append(loss_value)
        history["lr"].append(lr)
        if not math.isfinite(loss_value):
            stop_reason = "loss is not finite"
            log(f"{method}: stopping at step {step}: the training loss is {loss_value}")
            break
        if step % p.log_every == 0 or step == p.steps:
            memory.sample()
            history["tokens_per_s"].append([step, totals["tokens"] / max(totals["train_time_s"], 1e-9)])
            conv, whole = _record_structure(history, model, step, controller)
        if step % p.eval_every == 0 or step == p.steps:
            history["valid"].append([step, score()])
        if step % p.checkpoint_every == 0 and step < p.steps:
            save_checkpoint()
        bar.update(step, loss=loss_value, tokens_per_s=totals["tokens"] / max(totals["train_time_s"], 1e-9),
                   stage=stage_name(controller), compression=conv)
    bar.close()
    stepper.close()
    if stop_reason is None:
        stop_reason = "finished"
    # Always end on an evaluation of the current weights, for the report.
    if not history["valid"] or history["valid"][-1][0] != step:
        history["valid"].append([step, score()])
    if step >= p.steps and controller is not None:
        # Finished: cut dead ranks for good, so the saved model is small (the
        # gates are the same in every process, so are the cuts).
        import comera
        comera.prune(model, optimizer)
    if not history["compression"] or history["compression"][-1][0] != step:
        _record_structure(history, model, step, controller)
    save_checkpoint()
    result = _result(method, model, controller, p, step, stop_reason, history, totals, memory)
    if controller is not None:
        controller.detach()
    del model, optimizer, schedule, controller, stepper
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
        "final_ranks": persistence.tt_live_ranks(model), "summary": summary, "history": history,
    }
