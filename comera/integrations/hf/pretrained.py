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
import copy
import json
import logging
import os
import sys
import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn

from comera._version import __version__
from comera.convert import convert
from comera.integrations.hf import loading
from comera.layers.base import live_ranks, tt_layers
from comera.layers.tied import TiedTTLinear
from comera.storage import import_safetensors, load_state_dict, write_json

RECORD_KEY = "comera"
WEIGHTS = "comera-model.safetensors"
_PREFIX = "comera-"
_GUARD = ("comera: this folder holds tensor-train (comera) weights that plain from_pretrained "
          "cannot load; load it with comera.from_pretrained(cls, path)")
_FORMAT = 1
_UNTIED_CONFIGS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def mark_untied_copy(config) -> None:
    """Records a private config copy in which convert turned
    ``tie_word_embeddings`` off (:mod:`.ties`): a model that
    :func:`from_pretrained` builds from it is tied, as the original was."""
    _UNTIED_CONFIGS[id(config)] = config


def is_untied_copy(config) -> bool:
    return _UNTIED_CONFIGS.get(id(config)) is config


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
    ``copy.deepcopy`` and pickling carry it over to the copy.  ``root`` is
    the model ``convert`` was given, when ``model`` is a transformers model
    inside it (``model.bert``): its folder is a comera folder too."""

    def __init__(self, model: nn.Module, root: Optional[nn.Module] = None):
        self.model = model
        self.root = model if root is None else root

    def __call__(self, save_directory, *args, **kwargs):
        if kwargs.get("push_to_hub"):
            raise ValueError("save_pretrained: push_to_hub=True is not supported for a model "
                             "converted by comera (the folder is rewritten after saving): save it "
                             "locally, then upload the folder")
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        is_main = args[0] if args else kwargs.get("is_main_process", True)
        if is_main:
            finish_folder(self.model, os.fspath(save_directory), self.root)
        if "transformers.trainer" in sys.modules:   # a Trainer checkpoint it could not reload
            check_save()
        return result


def install_save_hook(model: nn.Module) -> None:
    """Makes ``model.save_pretrained`` write a comera folder (HF models only),
    and that of every transformers model inside it that holds TT layers
    (``model.bert.save_pretrained``), whose folder plain transformers would
    otherwise load with random layers."""
    if not is_hf_model(model):
        return
    for _, sub in model.named_modules():
        if sub is not model and (not is_hf_model(sub) or not any(True for _ in tt_layers(sub))):
            continue
        hook = sub.__dict__.get("save_pretrained")
        if not isinstance(hook, SavePretrained) or hook.model is not sub:
            sub.save_pretrained = SavePretrained(sub, model)


def remove_save_hook(model: nn.Module) -> None:
    for _, sub in model.named_modules():
        if isinstance(sub.__dict__.get("save_pretrained"), SavePretrained):
            del sub.__dict__["save_pretrained"]


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


def finish_folder(model: nn.Module, directory: str, root: Optional[nn.Module] = None) -> None:
    """Turns the folder ``transformers`` wrote for ``model`` (part of ``root``,
    the converted model, if given) into a comera folder."""
    weights = _rename_weights(directory)
    config_path = os.path.join(directory, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    untied = getattr(model if root is None else root, "_comera_untied_configs", [])
    if any(c is getattr(model, "config", None) for c in untied):
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
    """Converts the model's dense layers that the record names (layers it
    lacks are left out: their stored tensors are reported as unexpected),
    gives each recorded TT layer its recorded modes, and checks that every
    recorded layer now has its recorded type."""
    modules = dict(model.named_modules())
    embeddings = {id(modules[n].weight): n for n, info in layers.items()
                  if info["type"] == "TTEmbedding" and type(modules.get(n)) is nn.Embedding}
    for name, m in modules.items():
        # a head the model ties to a recorded embedding (one saved without it: a base model's
        # folder loaded into a head model) is tied to its TT weight too
        if type(m) is nn.Linear and name not in layers and id(m.weight) in embeddings:
            layers = {**layers, name: {"type": "TiedTTLinear", "embedding": embeddings[id(m.weight)]}}
    rank = {}
    for name, info in layers.items():
        m = modules.get(name)
        if type(m) in (nn.Linear, nn.Embedding):
            # ranks are resized to the stored ones when loading; a tied head's TT weight is
            # its embedding's, its own rank only sizes a throwaway build
            ranks = info.get("ranks") or [1]
            rank[_escape(name)] = 1 if info["type"] == "TiedTTLinear" else max(ranks)
    if rank:
        tied = any(info["type"] == "TiedTTLinear" for info in layers.values())
        quiet = _DropConvertLogs()
        logging.getLogger("comera").addFilter(quiet)
        try:
            convert(model, rank=rank, include=list(rank), embeddings=True, init="random",
                    min_compression=1e-12, tie="keep" if tied else "untie")
        finally:
            logging.getLogger("comera").removeFilter(quiet)
    loading.rebuild_shapes(model, layers)
    modules = dict(model.named_modules())
    for name, info in layers.items():
        if name in modules and type(modules[name]).__name__ != info["type"]:
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
    # a name the model declares tied to another (transformers' _tied_weights_keys, which
    # save_pretrained stores once) takes the other's value when it is a separate tensor here
    tensors = model.state_dict(keep_vars=True)
    for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
        if (target not in state and source in state and target in tensors
                and tuple(tensors[target].shape) == tuple(state[source].shape)):
            state[target] = state[source]


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


def _model_class(cls, config):
    """The class ``cls`` builds for ``config`` (itself, or an Auto class's pick)."""
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is not None:
        try:
            return mapping[type(config)]
        except KeyError:
            raise ValueError(f"from_pretrained: {cls.__name__} builds no model for a "
                             f"{type(config).__name__}") from None
    return cls


def _check_cls(cls):
    import transformers

    is_auto = hasattr(cls, "_model_mapping") and callable(getattr(cls, "from_config", None))
    if not is_auto and not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise TypeError("from_pretrained: cls must be a transformers model class (e.g. "
                        "BertForMaskedLM) or Auto class (e.g. AutoModelForMaskedLM), got "
                        f"{getattr(cls, '__name__', type(cls).__name__)}")
    return is_auto


def _config(cls, is_auto: bool, path: Optional[str], config, kwargs: dict):
    """(config, keyword arguments for the model's ``__init__``), as
    transformers splits them: without a config object, keyword arguments that
    are config attributes override them; with one, all go to ``__init__``."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        untied = is_untied_copy(config)
        config, model_kwargs = copy.deepcopy(config), dict(kwargs)
        if untied:
            config.tie_word_embeddings = True   # a converted model's config: built as the original
    else:
        source = config if config is not None else path
        if source is None:
            raise TypeError("from_pretrained: pass a folder path, or config= (a config or its "
                            "folder) with state_dict=")
        config_cls = transformers.AutoConfig if is_auto else cls.config_class
        config, model_kwargs = config_cls.from_pretrained(os.fspath(source), return_unused_kwargs=True,
                                                          **kwargs)
    for key in (RECORD_KEY, "transformers_weights"):
        if hasattr(config, key):
            delattr(config, key)   # the record describes the folder, not the in-memory model
    loading.check_model_kwargs(_model_class(cls, config), model_kwargs, _OPTIONS)
    return config, model_kwargs


def _build(cls, is_auto: bool, config, dtype, attn_implementation, model_kwargs: dict):
    kwargs = dict(model_kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if dtype is not None:
        kwargs["dtype"] = dtype
    with _parameters_on_meta():
        return cls.from_config(config, **kwargs) if is_auto else cls._from_config(config, **kwargs)


def _load_generation_config(model: nn.Module, path: Optional[str]) -> None:
    if path is None or not os.path.isfile(os.path.join(path, "generation_config.json")):
        return
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():
        import transformers

        model.generation_config = transformers.GenerationConfig.from_pretrained(path)


_OPTIONS = ("config, state_dict, dtype, torch_dtype, device, device_map, attn_implementation, "
            "output_loading_info, ignore_mismatched_sizes, low_cpu_mem_usage")


def from_pretrained(cls, path=None, *, config=None, state_dict: Optional[Dict[str, torch.Tensor]] = None,
                    dtype=None, torch_dtype=None, device=None, device_map=None,
                    attn_implementation: Optional[str] = None, output_loading_info: bool = False,
                    ignore_mismatched_sizes: bool = False, low_cpu_mem_usage=None, **kwargs):
    """Loads a folder that ``save_pretrained`` wrote for a converted model.

    Builds ``cls`` from the folder's config, converts it as recorded (the same
    layers, TT types, ranks and modes, pruned ranks and resized vocabularies
    included; tied heads tied again), loads the saved values exactly and
    returns the model in eval mode, like ``transformers``' ``from_pretrained``,
    whose options it takes with their meaning:

    Args:
        cls: a transformers model class (``BertForMaskedLM``) or an Auto class
            (``AutoModelForMaskedLM``).  Another class than the one saved
            loads as transformers loads it: a base model's folder into a
            head model (under ``base_model_prefix``) and back, the weights the
            folder lacks initialised and reported, its extra ones reported.
        path: the local folder; None with ``config=`` and ``state_dict=``.
        config: a config (then keyword arguments go to the model's
            ``__init__``) or the folder to read it from.
        state_dict: the weights, instead of a folder: a converted model's
            ``state_dict()``; its TT layers are read off its keys and shapes
            (or off the ``comera`` record of ``config``, when it has one).
        dtype: a torch dtype, its name, or ``"auto"``/None (the config's
            dtype, else the stored one); ``torch_dtype`` is its old name.
            Half precision works for tied heads too.
        device, device_map: the one device to load onto (``device_map`` as
            transformers takes it for a single device: ``"cuda:0"``, ``0``,
            ``{"": "cuda:0"}``; maps over several devices are refused).  By
            default the device of an enclosing ``with torch.device(...)``, else
            the CPU; under ``with torch.device("meta")`` it raises
            RuntimeError, as transformers does.
        attn_implementation: passed to ``transformers`` (``"eager"``, ``"sdpa"``).
        output_loading_info: also return ``{"missing_keys", "unexpected_keys",
            "mismatched_keys", "error_msgs"}``.
        ignore_mismatched_sizes: initialise, instead of refusing
            (RuntimeError), layers whose stored shape differs (a TT layer's
            ranks always follow the stored ones; other modes are a mismatch).
        low_cpu_mem_usage: accepted; the model is always built with its
            parameters on the meta device, as transformers 5 does.
        kwargs: config attributes to override (``hidden_dropout_prob=0.0``)
            or, with ``config=``, arguments of the model's ``__init__``;
            anything else raises TypeError naming it.

    Raises FileNotFoundError for a missing folder or file, ValueError for a
    folder without a comera record (a plain Hugging Face folder: use
    ``cls.from_pretrained``, then :func:`comera.convert`), TypeError when
    ``cls`` is not a model class or for unknown keyword arguments.

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
        >>> half = comera.from_pretrained(BertForMaskedLM, folder, dtype=torch.bfloat16)
        >>> type(half.cls.predictions.decoder).__name__, half(ids).logits.dtype
        ('TiedTTLinear', torch.bfloat16)
    """
    is_auto = _check_cls(cls)
    target = loading.target_device(device, device_map)
    if path is not None:
        if state_dict is not None:
            raise ValueError("from_pretrained: `state_dict` cannot be passed together with a folder")
        path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
        if not isinstance(path, str):
            raise TypeError(f"from_pretrained: path must be a folder path, got {type(path).__name__}")
        record = read_record(path)
        state = read_weights(path, record)
    elif state_dict is None:
        raise TypeError("from_pretrained: pass a folder path, or config= with state_dict=")
    else:
        record = getattr(config, RECORD_KEY, None) or {}
        state = dict(state_dict)
    config, model_kwargs = _config(cls, is_auto, path, config, kwargs)
    dtype = loading.resolve_dtype(dtype, torch_dtype, config, state)
    model = _build(cls, is_auto, config, dtype, attn_implementation, model_kwargs)

    rename = loading.prefix_bridge(model, state)
    unexpected = {k for k in state if rename(k) is None}
    state = {rename(k): v for k, v in state.items() if rename(k) is not None}
    if isinstance(record.get("layers"), dict):
        layers = loading.bridge_layers(record["layers"], rename)
    else:
        layers = loading.infer_layers(model, state)
    _convert_by_record(model, layers)
    install_save_hook(model)
    fill_shared(model, state)
    mismatched = loading.split_mismatched(model, state)
    _materialize(model, target)
    result = load_state_dict(model, state, strict=False)   # resizes TT ranks to the stored ones
    unexpected.update(result.unexpected_keys)
    loaded = set(state) - set(result.unexpected_keys)
    loading.init_missing(model, loaded)
    model.to(target)                                        # buffers
    # as transformers reports them: a tied name is not missing when its source is in the model
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    resized = {k for k, _, _ in mismatched}
    missing = {k for k in result.missing_keys if k not in tied and k not in resized}
    info = {"missing_keys": missing, "unexpected_keys": unexpected,
            "mismatched_keys": mismatched, "error_msgs": []}
    loading.report(model, path, info, ignore_mismatched_sizes)
    _load_generation_config(model, path)
    model.eval()
    return (model, info) if output_loading_info else model


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
