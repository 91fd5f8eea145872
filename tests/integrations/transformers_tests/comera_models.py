"""Model classes for transformers' ModelTesterMixin whose every construction
goes through :func:`comera.convert`.

``converted(BertForMaskedLM)`` is a subclass of ``BertForMaskedLM`` with the
same ``__name__`` (the mixin finds classes by name in transformers' Auto
mappings) whose ``__init__`` runs the class's own ``__init__`` and then
``comera.convert(self, rank=RANK)``, so ``model_class(config)``,
``model_class._from_config(config, ...)`` and a construction under
``torch.device("meta")`` all give converted models.  Its ``from_pretrained``
is :func:`comera.from_pretrained`, except for a plain transformers folder (a
dense model's, which the mixin writes with ``type(child)(config)``): that one
loads as transformers loads it and is then converted with ``init="svd"``, as
a user converts a pretrained model.  The subclass adds no state: everything
the tests check is the converted transformers model.
"""
import json
import os
from typing import Dict

import comera

RANK = 8
MIN_COMPRESSION = 1e-9
"""Every nn.Linear / nn.Embedding converts, even one that would not shrink
at the testers' tiny sizes: the tests then see TT layers everywhere."""

_MADE: Dict[type, type] = {}


def _is_comera_folder(path) -> bool:
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as f:
        return "comera" in json.load(f)


def converted(cls: type) -> type:
    """The converted counterpart of the transformers model class ``cls``."""
    if os.environ.get("COMERA_HF_TESTS_DENSE") == "1":
        return cls          # the same tests over the plain models, for comparison
    if cls in _MADE:
        return _MADE[cls]

    def __init__(self, config, *args, **kwargs):
        cls.__init__(self, config, *args, **kwargs)
        comera.convert(self, rank=RANK, min_compression=MIN_COMPRESSION)

    def from_pretrained(klass, pretrained_model_name_or_path=None, *args, **kwargs):
        path = pretrained_model_name_or_path
        if path is not None and not _is_comera_folder(path):
            out = cls.from_pretrained(path, *args, **kwargs)
            model = out[0] if isinstance(out, tuple) else out
            comera.convert(model, rank=RANK, min_compression=MIN_COMPRESSION, init="svd")
            model.__class__ = klass
            return out
        return comera.from_pretrained(klass, path, *args, **kwargs)

    made = type(cls.__name__, (cls,), {
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__name__}, converted by comera.convert(rank={RANK}) when built.",
        "from_pretrained": classmethod(from_pretrained),
    })
    _MADE[cls] = made
    return made
