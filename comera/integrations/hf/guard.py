"""Plain transformers never fills a model with comera weights it cannot hold.

A comera folder stops plain ``from_pretrained`` by itself (the
``transformers_weights`` entry of its config, see :mod:`.pretrained`), and so
does a config read from one (``config=``).  Weights handed over otherwise,
``Cls.from_pretrained(None, config=cfg, state_dict=tt_model.state_dict())``
or a folder of plain files that holds TT cores, would reach transformers'
loader, which only *reports* unexpected and missing keys and initialises the
missing weights at random.  :func:`install` wraps that loader
(``PreTrainedModel._load_pretrained_model``) with a check that raises
ValueError instead, before anything is loaded, when

* stored TT cores or gates (``<layer>.cores.K``) are meant for an
  ``nn.Linear``/``nn.Embedding`` of the model (a dense model handed a
  converted model's weights: use :func:`comera.from_pretrained`), or
* a TT layer of the model is handed a dense weight (``<layer>.weight``: load
  the dense model, then :func:`comera.convert` it with ``init="svd"``).

Names are matched as transformers matches them (with or without the model's
``base_model_prefix``).  ``import comera`` installs it when transformers'
``modeling_utils`` is already imported, else a one-shot import hook installs
it right after that module is first imported, so the import order does not
matter; nothing here imports transformers.
"""
import functools
import importlib.abc
import re
import sys
from typing import Iterable, List

from torch import nn

from comera.layers.base import is_tt_layer

_MODULE = "transformers.modeling_utils"
_TT_KEY = re.compile(r"^(?:(.*)\.)?(cores|gates)\.(\d+)$")


def problems(model: nn.Module, keys: Iterable[str]) -> List[str]:
    """The stored names that transformers' loader would leave unused because
    they are comera weights for a dense layer of ``model``, or dense weights
    for one of its TT layers (empty when the weights fit)."""
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""

    def find(name):
        candidates = [name]
        if prefix:
            candidates.append(f"{prefix}.{name}" if name else prefix)
            if name.startswith(prefix + "."):
                candidates.append(name[len(prefix) + 1:])
        for c in candidates:
            if c in modules:
                return c, modules[c]
        return None, None

    out = []
    for key in keys:
        tt = _TT_KEY.match(key)
        if tt:
            name, mod = find(tt.group(1) or "")
            if isinstance(mod, (nn.Linear, nn.Embedding)) and not is_tt_layer(mod):
                out.append(f"'{key}' holds TT weights for the {type(mod).__name__} '{name}'")
        elif key.endswith(".weight"):
            name, mod = find(key[:-len(".weight")])
            if mod is not None and is_tt_layer(mod):
                out.append(f"'{key}' is a dense weight for the {type(mod).__name__} '{name}'")
    return out


def check(model: nn.Module, keys: Iterable[str]) -> None:
    """Raises ValueError when :func:`problems` finds any."""
    found = problems(model, keys)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise ValueError(
            f"comera: these weights do not fit {type(model).__name__}: {'; '.join(found[:3])}{more}. "
            "Weights of a model converted by comera.convert load with comera.from_pretrained(cls, "
            "path) (or comera.from_pretrained(cls, config=config, state_dict=state_dict)); dense "
            "weights load into the dense model, which comera.convert(model, rank=..., "
            "init='svd') then converts")


def _stored_keys(state_dict, checkpoint_files) -> List[str]:
    if state_dict is not None:
        return list(state_dict)
    keys: List[str] = []
    for f in checkpoint_files or []:
        if str(f).endswith(".safetensors"):
            try:
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as fh:
                    keys.extend(fh.keys())
            except Exception:  # unreadable here: transformers' own loader reports it
                pass
    return keys


def _patch(modeling_utils) -> None:
    owner = getattr(modeling_utils, "PreTrainedModel", None)
    original = owner.__dict__.get("_load_pretrained_model") if owner is not None else None
    if not isinstance(original, staticmethod) or getattr(original.__func__, "_comera_guard", False):
        return   # another transformers layout: left alone (folders are still guarded)
    load = original.__func__

    @functools.wraps(load)
    def _load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs):
        check(model, _stored_keys(state_dict, checkpoint_files))
        return load(model, state_dict, checkpoint_files, *args, **kwargs)

    _load_pretrained_model._comera_guard = True
    owner._load_pretrained_model = staticmethod(_load_pretrained_model)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_patch` right after transformers' modeling_utils is
    imported, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Wraps transformers' loader now, or as soon as it is imported."""
    module = sys.modules.get(_MODULE)
    if module is not None and hasattr(module, "PreTrainedModel"):
        _patch(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
