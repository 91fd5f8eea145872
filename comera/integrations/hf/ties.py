"""What a ``transformers`` model needs after :func:`comera.convert` and
:func:`comera.to_dense`: ``transformers`` re-ties weights by parameter
*names*, and ``save_pretrained`` must write a comera folder.  Registered with
the converter (:func:`comera.convert.replace.register_model_hooks`) when this
module is imported, which ``import comera`` does; no ``transformers`` import.
"""
import copy

from torch import nn

from comera.convert.replace import register_model_hooks
from comera.integrations.hf import guard
from comera.integrations.hf.pretrained import (install_save_hook, is_hf_model, mark_untied_copy,
                                               remove_save_hook)
from comera.integrations.hf.resize import install_resize_hook, remove_resize_hook


def after_convert(model: nn.Module, tied_changed: bool) -> None:
    """transformers re-ties weights by parameter *names* (``tie_weights()``);
    names that vanished (``...word_embeddings.weight`` is now TT cores) would
    make it fail.  The tie now lives in the module structure (TiedTTLinear),
    so the name-based mapping entries that no longer resolve are dropped and
    ``config.tie_word_embeddings`` is turned off in a private copy of the
    config (the caller's config object, often shared with other models, is
    left alone); both are restored by :func:`to_dense`.  ``model.save_pretrained``
    now writes a folder that :func:`comera.from_pretrained` reloads and plain
    ``from_pretrained`` refuses, and ``model.resize_token_embeddings`` resizes
    a TT word embedding (:mod:`.resize`); :func:`to_dense` restores the
    class's own methods."""
    install_save_hook(model)
    if is_hf_model(model):
        guard.install()
        install_resize_hook(model)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        gone = {k: v for k, v in tied.items() if k not in names or v not in names}
        for k in gone:
            del tied[k]
        saved = getattr(model, "_comera_dropped_tied_keys", {})
        saved.update(gone)
        if saved:
            model._comera_dropped_tied_keys = saved
        declared = getattr(type(model), "_tied_weights_keys", None)
        if gone and isinstance(declared, dict):
            # the class's declaration, which transformers' tie checks read, loses the same entries
            # on this instance (to_dense restores the class's)
            model._tied_weights_keys = {k: v for k, v in declared.items() if k not in saved}
    if not tied_changed:
        return
    # HF models share one config object with the caller (and often with other models built
    # from it): give this model's modules a private copy before changing it.
    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if callable(getattr(m, "tie_weights", None)) and getattr(cfg, "tie_word_embeddings", False):
            configs[id(cfg)] = cfg
    changed = []
    for old in configs.values():
        new = copy.deepcopy(old)
        new.tie_word_embeddings = False
        mark_untied_copy(new)
        for m in model.modules():
            if getattr(m, "config", None) is old:
                m.config = new
        changed.append(new)
    if changed:
        model._comera_untied_configs = changed


def after_to_dense(model: nn.Module) -> None:
    remove_save_hook(model)
    remove_resize_hook(model)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    saved = getattr(model, "_comera_dropped_tied_keys", None)
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(saved, dict) and isinstance(tied, dict):
        for k, v in list(saved.items()):
            if k in names and v in names:
                tied[k] = v
                del saved[k]
        if not saved:
            del model._comera_dropped_tied_keys
    if "_tied_weights_keys" in model.__dict__ and not getattr(model, "_comera_dropped_tied_keys", None):
        del model.__dict__["_tied_weights_keys"]
    for cfg in getattr(model, "_comera_untied_configs", []):
        cfg.tie_word_embeddings = True
    if hasattr(model, "_comera_untied_configs"):
        del model._comera_untied_configs


register_model_hooks(after_convert, after_to_dense)
