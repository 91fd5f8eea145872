"""Hugging Face ``transformers`` integration.

- :mod:`.pretrained`: ``save_pretrained`` / :func:`from_pretrained` folders of
  converted models;
- :mod:`.ties`: the fix-ups ``convert`` / ``to_dense`` run on HF models;
- :mod:`.resize`: ``resize_token_embeddings`` of a converted model;
- :mod:`.guard`: plain ``from_pretrained`` refusing comera weights it would
  leave unused (installed here);
- :mod:`.loading`: the loader options of :func:`from_pretrained`;
- :mod:`.trainer`: :class:`RankAdaptiveCallback` for ``transformers.Trainer``;
- :mod:`.checkpoints`: :func:`patch_trainer`, resuming from and loading the
  best of a converted model's Trainer checkpoints.

Importing this package does not import ``transformers``: ``RankAdaptiveCallback``
and ``patch_trainer`` load it (with :mod:`.trainer`) on first access.
"""
from comera.integrations.hf import guard, ties  # noqa: F401  (ties registers the converter's HF fix-ups)
from comera.integrations.hf.pretrained import from_pretrained

guard.install()

_TRAINER_NAMES = ("RankAdaptiveCallback", "patch_trainer", "RANK_ADAPTIVE_STATE")


def __getattr__(name):
    # the Trainer glue needs transformers: loaded when first asked for, so that
    # ``import comera`` stays free of it
    if name in _TRAINER_NAMES:
        from comera.integrations.hf import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'comera.integrations.hf' has no attribute {name!r}")


__all__ = ["from_pretrained", "RankAdaptiveCallback", "patch_trainer"]
