"""Rank-adaptive training inside the Hugging Face ``transformers.Trainer``.

Two added lines turn a Trainer run into CoMERA's two-stage schedule::

    model = comera.convert(model, rank=32)                                   # 1
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[RankAdaptiveCallback(gamma=0.5, threshold=1e-2,    # 2
                                                      stage1_steps=500, stage2_steps=500,
                                                      target_compression=20.0)])
    trainer.train()

How it plugs in: when training begins the callback builds (or takes) the
:class:`comera.RankAdaptive` and attaches it to the Trainer's torch optimizer
(:meth:`comera.RankAdaptive.attach`, unwrapping accelerate's
AcceleratedOptimizer): after every real optimizer step the optimizer's
post-step hook runs the decoupled L1 step on the gates, the stage-2 size
controller and pruning (when ``prune_every`` is set).  A step that fp16's
GradScaler skips never reaches the optimizer, so it skips the stage logic too.
The reported training loss is the task loss; the callback's ``history`` keeps
(step, stage, compression) at every logging step, and the same numbers are
added to the log dict the Trainer hands to the callbacks after this one (the
printed progress lines among them) as ``comera_stage`` / ``comera_compression``.
When training ends the hooks are removed.

Checkpoints: the Trainer saves a converted model as a comera folder
(:mod:`comera.integrations.hf.pretrained`), which its own readers do not find.
``patch_trainer(trainer)`` (from :mod:`comera.integrations.hf.checkpoints`,
re-exported here) makes ``train(resume_from_checkpoint=...)`` and
``load_best_model_at_end`` read them, ranks of a pruned model included; the
callback writes its controller state (``comera_rank_adaptive.pt``) into every
checkpoint and restores it on resume and with the best model.

Limits: under multi-process training (DDP) leave ``prune_every`` unset and
prune after training (or in your own loop with
:func:`comera.integrations.ddp.prune`), because the Trainer's DDP wrapper
cannot be re-wrapped from a callback.

``transformers`` is imported when this module is, never by ``import comera``.
"""
import os
import warnings
from typing import List, Optional, Tuple

import torch

from comera.adapt.rank_adaptive import RankAdaptive

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("comera.integrations.hf needs the transformers package: "
                      "pip install transformers (or comera[train])") from err

from comera.integrations.hf.checkpoints import (RANK_ADAPTIVE_STATE, load_rank_adaptive,  # noqa: F401
                                                patch_trainer, save_rank_adaptive)
from comera.integrations.hf.pretrained import refuse_unpatched, running_trainer


def _unwrap_optimizer(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer (if wrapped)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class RankAdaptiveCallback(TrainerCallback):
    """Runs :class:`comera.RankAdaptive` inside ``transformers.Trainer``.

    Args:
        rank_adaptive: an existing controller; or leave it None and pass the
            :class:`comera.RankAdaptive` keyword arguments (gamma, threshold,
            stage1_steps, stage2_steps, target_compression, prune_every,
            min_rank), and it is built on the Trainer's model when training
            begins.

    Checkpoints: each one the Trainer saves gets the controller state
    (``comera_rank_adaptive.pt``, with ``history``); with :func:`patch_trainer`
    a resumed run continues from it (the controller is then built without
    rebalancing, as the weights and optimizer state are restored as saved),
    and ``load_best_model_at_end`` restores the best checkpoint's.  Resuming
    without the file raises.

    Example:
        >>> import comera
        >>> from comera.integrations.hf import RankAdaptiveCallback
        >>> cb = RankAdaptiveCallback(gamma=0.5, threshold=1e-2, stage1_steps=100,
        ...                           stage2_steps=100, target_compression=10.0)
        >>> # Trainer(model=comera.convert(model, rank=16), ..., callbacks=[cb]).train()
    """

    def __init__(self, rank_adaptive=None, **rank_adaptive_kwargs):
        if rank_adaptive is not None and rank_adaptive_kwargs:
            raise TypeError("RankAdaptiveCallback: pass either a RankAdaptive or its keyword "
                            f"arguments, not both (got {sorted(rank_adaptive_kwargs)})")
        if rank_adaptive is None and not rank_adaptive_kwargs:
            raise TypeError("RankAdaptiveCallback: pass a comera.RankAdaptive, or its keyword "
                            "arguments (gamma=..., threshold=..., stage1_steps=..., stage2_steps=...)")
        if rank_adaptive is not None and not callable(getattr(rank_adaptive, "penalty", None)):
            raise TypeError("RankAdaptiveCallback: rank_adaptive must be a comera.RankAdaptive, got "
                            f"{type(rank_adaptive).__name__}")
        if rank_adaptive_kwargs:
            with warnings.catch_warnings():    # validate the arguments now, not at train time
                warnings.simplefilter("ignore")
                RankAdaptive(torch.nn.Module(), **rank_adaptive_kwargs)
        self.rank_adaptive = rank_adaptive
        self._kwargs = rank_adaptive_kwargs
        self.history: List[Tuple[int, int, float]] = []
        self._resume_dir: Optional[str] = None

    # ------------------------------------------------------------- events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        resume, self._resume_dir = self._resume_dir, None
        if state.global_step == 0:
            resume = None   # left by a resume that failed before training began
        if state.global_step > 0 and resume is None:
            raise RuntimeError(
                f"RankAdaptiveCallback: training resumes at step {state.global_step}, but the "
                "controller state was not restored; call comera.integrations.hf.patch_trainer("
                "trainer) before trainer.train(resume_from_checkpoint=...)")
        if args.load_best_model_at_end:   # fail now rather than at the first checkpoint
            refuse_unpatched(running_trainer(), "RankAdaptiveCallback")
        saved = None
        if resume is not None:
            saved = load_rank_adaptive(resume)
            if saved is None:
                raise FileNotFoundError(
                    f"RankAdaptiveCallback: {resume!r} has no {RANK_ADAPTIVE_STATE}, so it was not "
                    "saved by a run with this callback; its rank schedule cannot be continued")
        if self.rank_adaptive is None:
            if model is None:
                raise RuntimeError("RankAdaptiveCallback: the Trainer gave no model to build "
                                   "the RankAdaptive controller on")
            kwargs = dict(self._kwargs)
            if saved is not None:
                kwargs["balance"] = False   # the loaded weights and optimizer state are as saved
            self.rank_adaptive = RankAdaptive(model, **kwargs)
        if saved is not None:
            self.rank_adaptive.load_state_dict(saved["rank_adaptive"])
            self.history = [tuple(h) for h in saved["history"]]
        self._attach(optimizer)

    def on_save(self, args, state, control, **kwargs):
        if self.rank_adaptive is None or not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):
            raise RuntimeError(f"RankAdaptiveCallback: the checkpoint folder {folder!r} the Trainer "
                               "just saved is not there (hyperparameter search runs save elsewhere "
                               "and are not supported), so the controller state cannot be saved")
        save_rank_adaptive(folder, {"rank_adaptive": self.rank_adaptive.state_dict(),
                                    "history": [list(h) for h in self.history]})

    # called by patch_trainer's checkpoint readers
    def _comera_resume_from(self, folder: str) -> None:
        self._resume_dir = folder   # read in on_train_begin, once the controller exists

    def _comera_load_best(self, folder: str) -> None:
        if self.rank_adaptive is None:
            return
        saved = load_rank_adaptive(folder)
        if saved is None:
            warnings.warn(f"RankAdaptiveCallback: the best checkpoint {folder!r} has no "
                          f"{RANK_ADAPTIVE_STATE}; the controller keeps the last step's state "
                          "while the model has the best checkpoint's weights", stacklevel=2)
            return
        self.rank_adaptive.load_state_dict(saved["rank_adaptive"])

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self._attach(optimizer)   # when the optimizer was not known at on_train_begin

    def _attach(self, optimizer) -> None:
        if optimizer is None or self.rank_adaptive._attached is not None:
            return
        self.rank_adaptive.attach(_unwrap_optimizer(optimizer))

    def on_train_end(self, args, state, control, **kwargs):
        if self.rank_adaptive is not None:
            self.rank_adaptive.detach()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.rank_adaptive is None:
            return
        ra = self.rank_adaptive
        entry = (state.global_step, ra.stage, float(ra.compression()))
        self.history.append(entry)
        if logs is not None:
            logs["comera_stage"] = entry[1]
            logs["comera_compression"] = round(entry[2], 3)
