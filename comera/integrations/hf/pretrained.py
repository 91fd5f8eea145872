"""Hugging Face ``save_pretrained`` / ``from_pretrained`` for converted models.

After :func:`comera.convert` on a ``transformers`` model, ``model.save_pretrained(d)``
writes a folder that records its TT structure, and :func:`from_pretrained`
rebuilds the model from it, converted the same way (pruned ranks included),
with the saved values.  What the folder holds:

* ``config.json``: the model's config as ``transformers`` writes it (with
  ``tie_word_embeddings`` as it was before conversion), plus a ``comera`` entry
  (per TT layer its type, ranks, live ranks and mode sizes; the model class;
  the weights file) and a ``transformers_weights`` entry whose text tells a
  plain ``from_pretrained`` to use :func:`comera.from_pretrained` instead.
* ``comera-model.safetensors`` (or ``comera-model.safetensors.index.json`` and
  its shards): ``transformers``' own weights file, renamed.  Plain
  ``from_pretrained`` reads only ``model.safetensors``/``pytorch_model.bin``,
  so it can never load this folder as a dense model with random TT layers: it
  raises instead (transformers 5 with the message above; any version at least
  "no file named model.safetensors").

The save side is a ``save_pretrained`` attribute that ``convert`` sets on the
model instance (``to_dense`` removes it, so a densified model saves as a plain
``transformers`` folder).  ``transformers`` is imported only by
:func:`from_pretrained`, never by ``import comera``.
"""
import contextlib
import json
import logging
import os
import sys
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn

from comera._version import __version__
from comera.convert import convert
from comera.layers.base import live_ranks, tt_layers
from comera.layers.tied import TiedTTLinear
from comera.storage import import_safetensors, load_state_dict, write_json

RECORD_KEY = "comera"
WEIGHTS = "comera-model.safetensors"
_PREFIX = "comera-"
_GUARD = ("comera: this folder holds tensor-train (comera) weights that plain from_pretrained "
          "cannot load; load it with comera.from_pretrained(cls, path)")
_FORMAT = 1


# ------------------------------------------------------------------ save side
def is_hf_model(model: nn.Module) -> bool:
    """True for ``transformers.PreTrainedModel`` instances, found without
    importing transformers (a class of that name defined in a transformers module)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


class SavePretrained:
    """``model.save_pretrained`` of a converted ``transformers`` model.

    Runs the class's own ``save_pretrained`` (every argument passed on), then
    renames the weights file(s) and adds the TT record to ``config.json``.
    An object holding the model (rather than a bound method) so that
    ``copy.deepcopy`` and pickling carry it over to the copy."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        if kwargs.get("push_to_hub"):
            raise ValueError("save_pretrained: push_to_hub=True is not supported for a model "
                             "converted by comera (the folder is rewritten after saving): save it "
                             "locally, then upload the folder")
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        is_main = args[0] if args else kwargs.get("is_main_process", True)
        if is_main:
            finish_folder(self.model, os.fspath(save_directory))
        if "transformers.trainer" in sys.modules:   # a Trainer checkpoint it could not reload
            check_save()
        return result


def install_save_hook(model: nn.Module) -> None:
    """Makes ``model.save_pretrained`` write a comera folder (HF models only)."""
    if is_hf_model(model) and not isinstance(model.__dict__.get("save_pretrained"), SavePretrained):
        model.save_pretrained = SavePretrained(model)


def remove_save_hook(model: nn.Module) -> None:
    if isinstance(model.__dict__.get("save_pretrained"), SavePretrained):
        del model.__dict__["save_pretrained"]


def structure(model: nn.Module) -> Dict[str, dict]:
    """Per TT layer of ``model``: ``{"type", "ranks", "live_ranks", "modes"}``;
    per tied TT head: ``{"type": "TiedTTLinear", "embedding": name}``.

    Example:
        >>> import torch, comera
        >>> net = comera.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), rank=4)
        >>> structure(net)["0"]["ranks"]
        [4, 4, 4, 4, 4]
    """
    names = {id(m): n for n, m in model.named_modules()}
    record = {}
    for name, layer in tt_layers(model):
        cores = list(layer.cores)
        record[name] = {"type": type(layer).__name__,
                        "ranks": [int(c.shape[-1]) for c in cores[:-1]],
                        "live_ranks": live_ranks(layer),
                        "modes": [list(c.shape[1:-1]) for c in cores]}
    for name, m in model.named_modules():
        if isinstance(m, TiedTTLinear):
            if id(m.embedding) not in names:
                raise ValueError(f"save_pretrained: '{name}' is tied to a TT embedding that is not "
                                 "part of the model")
            record[name] = {"type": "TiedTTLinear", "embedding": names[id(m.embedding)]}
    return record


def _hf_weight_files(directory: str) -> List[str]:
    return sorted(f for f in os.listdir(directory) if f.startswith("model")
                  and (f.endswith(".safetensors") or f.endswith(".safetensors.index.json")))


def _rename_weights(directory: str) -> str:
    """Gives the weight files ``transformers`` just wrote the comera names;
    returns the name of the main one (file or index)."""
    files = _hf_weight_files(directory)
    if not files:
        raise RuntimeError(f"save_pretrained wrote no safetensors weights in {directory!r}; "
                           "comera folders need safetensors (do not pass safe_serialization=False)")
    main = None
    for f in files:
        src, dst = os.path.join(directory, f), os.path.join(directory, _PREFIX + f)
        if f.endswith(".index.json"):
            with open(src, encoding="utf-8") as fh:
                index = json.load(fh)
            index["weight_map"] = {k: _PREFIX + v for k, v in index.get("weight_map", {}).items()}
            write_json(dst, index, indent=2, sort_keys=True)
            os.unlink(src)
            main = _PREFIX + f
        else:
            os.replace(src, dst)
    main = main or (_PREFIX + files[0] if len(files) == 1 else None)
    if main is None:
        raise RuntimeError(f"save_pretrained wrote several weight files but no index in {directory!r}")
    written = {_PREFIX + f for f in files}
    for f in os.listdir(directory):   # shards of an earlier, larger save
        if f.startswith(_PREFIX + "model") and f not in written:
            os.unlink(os.path.join(directory, f))
    return main


def finish_folder(model: nn.Module, directory: str) -> None:
    """Turns the folder ``transformers`` wrote for ``model`` into a comera folder."""
    weights = _rename_weights(directory)
    config_path = os.path.join(directory, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if any(c is getattr(model, "config", None) for c in getattr(model, "_comera_untied_configs", [])):
        config["tie_word_embeddings"] = True   # convert untied a private copy; the architecture ties
    config[RECORD_KEY] = {"format": _FORMAT, "version": __version__,
                          "class": type(model).__name__, "weights": weights,
                          "layers": structure(model)}
    config["transformers_weights"] = _GUARD
    write_json(config_path, config, indent=2, sort_keys=True)


# ------------------------------------------------------------------ load side
def read_record(path) -> dict:
    """The ``comera`` entry of the folder's ``config.json``; ValueError when absent.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> with open(os.path.join(d, "config.json"), "w") as f:
        ...     _ = f.write('{"model_type": "bert"}')
        >>> read_record(d)
        Traceback (most recent call last):
        ...
        ValueError: from_pretrained: ... has no 'comera' entry, so it was not saved from a model ...
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_pretrained: path must be a folder written by save_pretrained "
                                f"of a converted model, got {path!r} (not a directory)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"from_pretrained: no config.json in {path!r}")
    with open(config_path, encoding="utf-8") as f:
        record = json.load(f).get(RECORD_KEY)
    if not isinstance(record, dict) or not isinstance(record.get("layers"), dict):
        raise ValueError(f"from_pretrained: config.json in {path!r} has no '{RECORD_KEY}' entry, so "
                         "it was not saved from a model converted by comera.convert; load a plain "
                         "Hugging Face folder with the class's own from_pretrained")
    if record.get("format") != _FORMAT:
        raise ValueError(f"from_pretrained: {path!r} has comera format {record.get('format')!r}; "
                         f"this comera reads format {_FORMAT}")
    return record


def _escape(name: str) -> str:
    """A glob that matches exactly ``name`` (module names are fnmatch patterns in convert)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


class _DropConvertLogs(logging.Filter):
    """convert's summary and its 'untying' warning describe choices made before
    saving; repeating them on every load would be noise."""

    def filter(self, record):
        return not record.getMessage().startswith("comera.convert")


def _convert_by_record(model: nn.Module, layers: Dict[str, dict]) -> None:
    modules = dict(model.named_modules())
    rank = {}
    for name, info in layers.items():
        m = modules.get(name)
        if m is None:
            raise ValueError(f"from_pretrained: the folder records a {info.get('type')} at "
                             f"'{name}' but the model built from its config has no module there")
        if type(m) in (nn.Linear, nn.Embedding):
            # a tied head's TT weight is its embedding's: its own rank only sizes a throwaway build
            rank[_escape(name)] = 1 if info["type"] == "TiedTTLinear" else list(info["ranks"])
    if rank:
        tied = any(info["type"] == "TiedTTLinear" for info in layers.values())
        quiet = _DropConvertLogs()
        logging.getLogger("comera").addFilter(quiet)
        try:
            convert(model, rank=rank, include=list(rank), embeddings=True, init="random",
                    min_compression=1e-12, tie="keep" if tied else "untie")
        finally:
            logging.getLogger("comera").removeFilter(quiet)
    modules = dict(model.named_modules())
    for name, info in layers.items():
        if type(modules[name]).__name__ != info["type"]:
            raise ValueError(f"from_pretrained: '{name}' was saved as a {info['type']} but converts "
                             f"to a {type(modules[name]).__name__} here")


def read_weights(path: str, record: dict) -> Dict[str, torch.Tensor]:
    st, _ = import_safetensors()
    main = record.get("weights", WEIGHTS)
    main_path = os.path.join(path, main)
    if not os.path.isfile(main_path):
        raise FileNotFoundError(f"from_pretrained: the weights file {main!r} named in "
                                f"{os.path.join(path, 'config.json')!r} is missing")
    files = [main]
    if main.endswith(".index.json"):
        with open(main_path, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    state: Dict[str, torch.Tensor] = {}
    for f in files:
        state.update(st.load_file(os.path.join(path, f), device="cpu"))
    return state


def fill_shared(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """transformers stores a tensor shared by several names once (BERT's decoder
    bias is ``cls.predictions.bias``): give every name of it the stored value."""
    groups: Dict[int, List[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    for names in groups.values():
        stored = [n for n in names if n in state]
        for n in names:
            if stored and n not in state:
                state[n] = state[stored[0]]


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device (no memory, and the
    model's random init of them costs nothing); buffers stay real, because
    models compute the non-persistent ones (BERT's ``position_ids``) in
    ``__init__`` and no checkpoint holds them."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.detach().to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(model: nn.Module, device) -> None:
    """Replaces every meta Parameter by one with uninitialised storage on
    ``device``; a Parameter held by several modules (a shared bias) gets one
    replacement everywhere, so ties stay ties.  The load then fills them all."""
    new: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                          requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]


def _build(cls, path: str, dtype, attn_implementation, config_kwargs: dict):
    import transformers

    is_auto = hasattr(cls, "_model_mapping") and callable(getattr(cls, "from_config", None))
    if not is_auto and not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise TypeError("from_pretrained: cls must be a transformers model class (e.g. "
                        "BertForMaskedLM) or Auto class (e.g. AutoModelForMaskedLM), got "
                        f"{getattr(cls, '__name__', type(cls).__name__)}")
    config_cls = transformers.AutoConfig if is_auto else cls.config_class
    config, unused = config_cls.from_pretrained(path, return_unused_kwargs=True, **config_kwargs)
    if unused:
        raise TypeError(f"from_pretrained: unexpected keyword arguments {sorted(unused)} (neither "
                        "dtype, device, attn_implementation nor attributes of the model's config)")
    for key in (RECORD_KEY, "transformers_weights"):
        if hasattr(config, key):
            delattr(config, key)   # the record describes the folder, not the in-memory model
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with _parameters_on_meta():
        return cls.from_config(config, **kwargs) if is_auto else cls._from_config(config, **kwargs)


def from_pretrained(cls, path, *, dtype: Optional[torch.dtype] = None, device=None,
                    attn_implementation: Optional[str] = None, **config_kwargs) -> nn.Module:
    """Loads a folder that ``save_pretrained`` wrote for a converted model.

    Builds ``cls`` from the folder's config, converts it as recorded (the same
    layers, TT types and ranks, pruned ranks included; tied heads tied again),
    loads the saved values exactly and returns the model in eval mode, like
    ``transformers``' ``from_pretrained``.

    Args:
        cls: the model class saved (``BertForMaskedLM``) or an Auto class
            (``AutoModelForMaskedLM``) that builds it.
        path: the local folder.
        dtype: build and load in this dtype (default: the config's).
        device: move the loaded model there.
        attn_implementation: passed to ``transformers`` (``"eager"``, ``"sdpa"``).
        config_kwargs: config attributes to override (``hidden_dropout_prob=0.0``).

    Raises FileNotFoundError for a missing folder or file, ValueError for a
    folder without a comera record (a plain Hugging Face folder: use
    ``cls.from_pretrained``), TypeError when ``cls`` is not a model class or
    builds another class than the one saved.

    Example:
        >>> import tempfile, torch, comera
        >>> from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM
        >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
        ...                  num_attention_heads=2, intermediate_size=64)
        >>> model = comera.convert(BertForMaskedLM(cfg), rank=4).eval()
        >>> folder = tempfile.mkdtemp()
        >>> model.save_pretrained(folder)
        >>> again = comera.from_pretrained(AutoModelForMaskedLM, folder)
        >>> ids = torch.tensor([[1, 5, 7, 2]])
        >>> torch.equal(again(ids).logits, model(ids).logits)
        True
    """
    path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    if not isinstance(path, str):
        raise TypeError(f"from_pretrained: path must be a folder path, got {type(path).__name__}")
    record = read_record(path)
    model = _build(cls, path, dtype, attn_implementation, config_kwargs)
    if type(model).__name__ != record.get("class"):
        raise TypeError(f"from_pretrained: the folder holds a {record.get('class')}, but "
                        f"{cls.__name__} builds a {type(model).__name__}; pass "
                        f"{record.get('class')} or the Auto class that builds it")
    _convert_by_record(model, record["layers"])
    install_save_hook(model)
    state = read_weights(path, record)
    fill_shared(model, state)
    _materialize(model, torch.device("cpu") if device is None else torch.device(device))
    load_state_dict(model, state, strict=True)   # resizes TT ranks to the saved ones first
    if device is not None:
        model.to(device)                          # buffers
    return model.eval()


# -------------------------------------- Trainer checks (transformers not imported)
PATCHED = "_comera_checkpoints"
"""The attribute patch_trainer sets on a Trainer."""


def is_patched(trainer) -> bool:
    """True once :func:`patch_trainer` ran on ``trainer``."""
    return bool(getattr(trainer, PATCHED, False))


def saves_comera_folders(model) -> bool:
    """True for a model whose ``save_pretrained`` writes comera folders (a
    ``transformers`` model converted by comera.convert)."""
    return model is not None and isinstance(model.__dict__.get("save_pretrained"), SavePretrained)


def running_trainer(method: Optional[str] = None):
    """The ``transformers.Trainer`` whose method (``method``, or any) is on
    the call stack, or None.

    Used only to refuse configurations that would lose data: finding none
    means nothing is checked."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if method is None or frame.f_code.co_name == method:
            owner = frame.f_locals.get("self")
            if isinstance(owner, transformers.Trainer):
                return owner
        frame = frame.f_back
    return None


def refuse_unpatched(trainer, where: str) -> None:
    """Raises when ``trainer`` (not patched) would silently keep the last model."""
    if trainer is None or is_patched(trainer) or not saves_comera_folders(trainer.model):
        return
    if getattr(trainer.args, "load_best_model_at_end", False):
        raise RuntimeError(
            f"comera: {where}: this Trainer has load_best_model_at_end=True but cannot read the "
            "comera checkpoint folders of a converted model (it would keep the last model); call "
            "comera.integrations.hf.patch_trainer(trainer) before trainer.train()")
    if not getattr(trainer, "_comera_warned", False):
        trainer._comera_warned = True
        warnings.warn("comera: a Trainer saves checkpoints of a converted model; to resume from them "
                      "call comera.integrations.hf.patch_trainer(trainer) before trainer.train() "
                      "(without it resume_from_checkpoint raises)", stacklevel=3)


def check_save() -> None:
    """Called by a converted model's ``save_pretrained`` after writing: raises
    when a Trainer without :func:`patch_trainer` saves it as a checkpoint and
    would not find it again for ``load_best_model_at_end``."""
    refuse_unpatched(running_trainer("_save_checkpoint"), "saving a checkpoint")
