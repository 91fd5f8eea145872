"""``transformers.Trainer`` checkpoints of a model converted by comera.

The Trainer saves a checkpoint with the model's ``save_pretrained``, which for
a converted model writes a comera folder (``comera-model.safetensors`` and a
``comera`` record in ``config.json``, see :mod:`comera.integrations.hf.pretrained`).  The
Trainer's own readers only look for ``model.safetensors``: resuming raises
"Can't find a valid checkpoint", and ``load_best_model_at_end`` logs a warning
and keeps the last model.  :func:`patch_trainer` gives one Trainer instance
readers for comera folders:

* ``train(resume_from_checkpoint=...)``: the weights are loaded into the
  Trainer's model before the optimizer is built, each TT layer resized to the
  checkpoint's ranks first (a model pruned during training resumes with its
  pruned shapes, so the saved optimizer state fits).  The Trainer restores the
  optimizer, scheduler, RNG and its own state as usual; a
  :class:`~comera.integrations.hf.RankAdaptiveCallback` restores its
  controller from the ``comera_rank_adaptive.pt`` file it writes into every
  checkpoint.
* ``load_best_model_at_end=True``: the best checkpoint's weights (and ranks)
  are loaded into the model, and the callback's controller state with them.

Folders without a ``comera`` record go to the Trainer's own readers, except a
plain checkpoint for a converted ``transformers`` model: that raises, since
its weights (saved before converting) cannot fill the TT layers.

Without the patch nothing is lost silently: resuming raises (the Trainer's
error), and a converted model saved by a Trainer that has
``load_best_model_at_end=True`` raises at its first checkpoint (after writing
it), since the Trainer would otherwise keep the last model at the end.

The patch replaces the Trainer's private ``_load_from_checkpoint`` and
``_load_best_model`` on the instance; a transformers version without them is
refused by :func:`patch_trainer` with an error that says so.  DeepSpeed and
FSDP runs (which load checkpoints their own way) are refused at load time.
"""
import json
import logging
import os
from typing import Optional

import torch
from torch import nn

from comera.integrations.hf.pretrained import (PATCHED, RECORD_KEY, fill_shared, read_record,
                                               read_weights, saves_comera_folders, structure)
from comera.storage import atomic_write, load_state_dict

try:
    import transformers
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("comera.integrations.hf.checkpoints needs the transformers package: "
                      "pip install transformers (or comera[train])") from err

RANK_ADAPTIVE_STATE = "comera_rank_adaptive.pt"
_METHODS = ("_load_from_checkpoint", "_load_best_model")
logger = logging.getLogger("comera")


def patch_trainer(trainer):
    """Makes ``trainer`` resume from, and load the best model from, comera folders.

    Call it once, before ``trainer.train()``; returns ``trainer``.  See the
    module doc for what is restored.  Calling it again does nothing.

    Raises TypeError when ``trainer`` is not a ``transformers.Trainer`` and
    RuntimeError when this transformers version lacks the private methods the
    patch replaces (``_load_from_checkpoint``, ``_load_best_model``).

    Example:
        >>> import tempfile, comera, transformers
        >>> from comera.integrations.hf import patch_trainer
        >>> cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
        ...                               num_attention_heads=2, intermediate_size=64)
        >>> model = comera.convert(transformers.BertForMaskedLM(cfg), rank=4)
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
        >>> trainer = patch_trainer(transformers.Trainer(model=model, args=args))
        >>> # trainer.train(resume_from_checkpoint=True) now reads comera checkpoints
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"patch_trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, PATCHED, False):
        return trainer
    missing = [m for m in _METHODS if not callable(getattr(type(trainer), m, None))]
    if missing:
        raise RuntimeError(f"patch_trainer: this transformers {transformers.__version__} Trainer has no "
                           f"{', '.join(missing)} (private methods that comera replaces to read its "
                           "checkpoint folders); load checkpoints with comera.from_pretrained instead")
    original_resume = trainer._load_from_checkpoint
    original_best = trainer._load_best_model

    def _load_from_checkpoint(resume_from_checkpoint, model=None):
        if not is_comera_folder(resume_from_checkpoint):
            _refuse_dense(model if model is not None else trainer.model, resume_from_checkpoint)
            original_resume(resume_from_checkpoint, model)
        else:
            _refuse_sharded_engines(trainer, "resume_from_checkpoint")
            load_folder(model if model is not None else trainer.model, resume_from_checkpoint)
        for cb in trainer.callback_handler.callbacks:   # RankAdaptiveCallback restores its state
            if callable(getattr(cb, "_comera_resume_from", None)):
                cb._comera_resume_from(resume_from_checkpoint)

    def _load_best_model():
        folder = trainer.state.best_model_checkpoint
        if not is_comera_folder(folder):
            _refuse_dense(trainer.model, folder)
            return original_best()
        _refuse_sharded_engines(trainer, "load_best_model_at_end")
        logger.info("comera: loading the best model from %s (score: %s)", folder,
                    trainer.state.best_metric)
        load_folder(trainer.model, folder)
        for cb in trainer.callback_handler.callbacks:
            if callable(getattr(cb, "_comera_load_best", None)):
                cb._comera_load_best(folder)

    trainer._load_from_checkpoint = _load_from_checkpoint
    trainer._load_best_model = _load_best_model
    setattr(trainer, PATCHED, True)
    return trainer


def is_comera_folder(path) -> bool:
    """True for a folder whose ``config.json`` has a ``comera`` record (which
    :func:`load_folder` then checks)."""
    config = os.path.join(os.fspath(path), "config.json") if isinstance(path, (str, os.PathLike)) \
        else None
    if config is None or not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as f:
        return RECORD_KEY in json.load(f)


def _refuse_dense(model, folder) -> None:
    if saves_comera_folders(model) and os.path.isdir(str(folder)):
        raise ValueError(f"comera: {folder!r} is a plain Trainer checkpoint without a 'comera' "
                         "record (saved before the model was converted), and its weights cannot "
                         "fill the model's TT layers; resume a converted model only from "
                         "checkpoints saved after converting it")


def _refuse_sharded_engines(trainer, what: str) -> None:
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise NotImplementedError(f"comera: {what} with DeepSpeed or FSDP is not supported for a "
                                  "converted model; load the folder with comera.from_pretrained")


def load_folder(model: nn.Module, folder: str) -> None:
    """Loads a comera folder's weights into ``model`` (converted the same way:
    same TT layers; ranks may differ and are taken from the folder).

    Raises ValueError when the folder was saved from another class or other TT
    layers, naming them; nothing is changed then."""
    record = read_record(folder)
    if record.get("class") != type(model).__name__:
        raise ValueError(f"comera: {folder!r} holds a {record.get('class')}, the Trainer's model is "
                         f"a {type(model).__name__}")
    saved = {n: i["type"] for n, i in record["layers"].items()}
    mine = {n: i["type"] for n, i in structure(model).items()}
    if saved != mine:
        diff = sorted(n for n in set(saved) | set(mine) if saved.get(n) != mine.get(n))
        raise ValueError(f"comera: {folder!r} was saved from a model converted otherwise; TT layers "
                         f"that differ (saved / this model): "
                         + ", ".join(f"{n}: {saved.get(n)} / {mine.get(n)}" for n in diff[:8]))
    state = read_weights(folder, record)
    fill_shared(model, state)
    load_state_dict(model, state, strict=True)   # TT layers take the folder's ranks first


# -------------------------------------------------------- RankAdaptive state
def save_rank_adaptive(folder: str, state: dict) -> None:
    """Writes the callback's state next to a checkpoint's weights."""
    atomic_write(os.path.join(folder, RANK_ADAPTIVE_STATE), lambda tmp: torch.save(state, tmp))


def load_rank_adaptive(folder: str) -> Optional[dict]:
    """The state :func:`save_rank_adaptive` wrote there, or None if absent."""
    path = os.path.join(folder, RANK_ADAPTIVE_STATE)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------- the unpatched Trainer
