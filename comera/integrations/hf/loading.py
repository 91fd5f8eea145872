"""The parts of :func:`comera.from_pretrained` that give transformers' loader
options their meaning: dtype, device and device_map, the keyword arguments
that go to the config or to the model's ``__init__``, base/head checkpoints
(``base_model_prefix``), shape mismatches, the weights a checkpoint lacks
(initialised as transformers does) and the loading report.

Nothing here imports transformers at module level: :func:`report` imports
it when called, from :func:`comera.from_pretrained`, which already has.
"""
import inspect
import logging
import math
import re
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from comera.layers.base import checkpoint_shapes, is_tt_layer, tt_layers
from comera.layers.embedding import TTEmbedding
from comera.layers.linear import TTLinear
from comera.layers.tied import TiedTTLinear

logger = logging.getLogger("comera")

_TT_KEY = re.compile(r"^(?:(.*)\.)?(cores|gates)\.(\d+)$")
_OWN_KEY = re.compile(r"(cores|gates)\.\d+")
_MULTI_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
META_CONTEXT_ERROR = (
    "You are using `from_pretrained` with a meta device context manager or "
    "`torch.set_default_device('meta')`.\nThis is an anti-pattern as `from_pretrained` wants to load "
    "existing weights.\nIf you want to initialize an empty model on the meta device, use the context "
    "manager or global device with `from_config`, or `ModelClass(config)`")


# ------------------------------------------------------------ dtype and device
def resolve_dtype(dtype, torch_dtype, config, state: Dict[str, torch.Tensor]) -> Optional[torch.dtype]:
    """transformers' ``dtype`` (``torch_dtype`` is its old name): a torch
    dtype, its name (``"bfloat16"``) or ``"auto"``/None: the config's
    ``dtype``, else the dtype of the first floating-point tensor stored."""
    if dtype is None:
        dtype = torch_dtype
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            dtype = next((t.dtype for t in state.values()
                          if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
            if dtype is None:
                return None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError("from_pretrained: dtype must be a floating torch.dtype, its name "
                         f"(\"bfloat16\") or \"auto\", got {dtype!r}")
    return dtype


def _context_device() -> Optional[torch.device]:
    """The device of a ``with torch.device(...)`` block or of
    ``torch.set_default_device`` (None for the CPU default), as transformers reads it."""
    here, default = torch.tensor([]).device, torch.get_default_device()
    if here == default:
        return None if default == torch.device("cpu") else default
    return here


def target_device(device, device_map) -> torch.device:
    """The one device the model is loaded onto.

    ``device_map`` as transformers takes it for one device (``"cpu"``,
    ``"cuda:0"``, ``0``, ``torch.device``, ``{"": device}`` or a map whose
    values are all one device); maps over several devices are refused.
    Without either, the device of an enclosing ``with torch.device(...)``
    (refused for the meta device, as transformers does), else the CPU."""
    if device is not None and device_map is not None:
        raise TypeError("from_pretrained: pass device or device_map, not both")
    if device_map is None and device is None:
        found = _context_device()
        if found is not None and found.type == "meta":
            raise RuntimeError(META_CONTEXT_ERROR)
        return found or torch.device("cpu")
    value = device if device is not None else device_map
    if isinstance(value, dict):
        devices = {str(torch.device(v) if not isinstance(v, int) else torch.device("cuda", v))
                   for v in value.values()}
        if len(devices) != 1:
            raise ValueError(f"from_pretrained: device_map {value!r} spreads the model over "
                             f"{sorted(devices)}; comera.from_pretrained loads onto one device "
                             "(device_map='cuda:0' or {'': 'cuda:0'})")
        value = next(iter(value.values()))
    if isinstance(value, str) and value in _MULTI_DEVICE_MAPS:
        raise ValueError(f"from_pretrained: device_map={value!r} dispatches the model over the "
                         "available devices, which comera.from_pretrained does not do; pass one "
                         "device (device_map='cuda:0', 'cpu', 0)")
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(f"from_pretrained: device_map must be a device, a device name, an int or "
                        f"a dict {{'': device}}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"from_pretrained: device_map must not be negative, got {value}")
        return torch.device("cuda", value)
    out = torch.device(value)
    if out.type == "meta":
        raise ValueError("from_pretrained: cannot load weights onto the meta device")
    return out


# ------------------------------------------------------------ keyword arguments
def init_arguments(model_cls: type) -> Tuple[Set[str], bool]:
    """The keyword arguments ``model_cls.__init__`` takes besides the config,
    and whether it takes any (``**kwargs``)."""
    params = list(inspect.signature(model_cls.__init__).parameters.values())[2:]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def check_model_kwargs(model_cls: type, kwargs: dict, options: str) -> None:
    """TypeError naming the keyword arguments that neither comera.from_pretrained,
    the config nor ``model_cls.__init__`` takes."""
    named, anything = init_arguments(model_cls)
    unknown = sorted(k for k in kwargs if k not in named)
    if unknown and not anything:
        raise TypeError(f"from_pretrained: unexpected keyword arguments {unknown} (neither options "
                        f"of comera.from_pretrained ({options}), attributes of the model's config, "
                        f"nor arguments of {model_cls.__name__}.__init__)")


# ------------------------------------------------------- base and head checkpoints
def prefix_bridge(model: nn.Module, keys) -> Callable[[str], Optional[str]]:
    """How a stored name maps onto ``model``, as transformers bridges base
    and head checkpoints through ``base_model_prefix``: a base model's
    checkpoint loads into a head model under the prefix, a head model's into
    the base model without it (its head's names map to None: unexpected)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return lambda k: k
    stored_has = any(k == prefix or k.startswith(prefix + ".") for k in keys)
    model_has = isinstance(getattr(model, prefix, None), nn.Module)
    if model_has and not stored_has:
        return lambda k: f"{prefix}.{k}" if k else prefix
    if stored_has and not model_has:
        return lambda k: (k[len(prefix) + 1:] if k.startswith(prefix + ".")
                          else "" if k == prefix else None)
    return lambda k: k


def bridge_layers(layers: Dict[str, dict], rename) -> Dict[str, dict]:
    """The record's layers under the model's names (dropping those the model lacks)."""
    out = {}
    for name, info in layers.items():
        new = rename(name)
        if new is None:
            continue
        info = dict(info)
        if info.get("type") == "TiedTTLinear":
            info["embedding"] = rename(info["embedding"])
            if info["embedding"] is None:
                continue
        out[new] = info
    return out


def infer_layers(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, dict]:
    """A record (as ``save_pretrained`` writes it) read off a state dict: each
    module with ``cores.K`` entries is a TT layer of the kind its dense
    module converts to, with the stored ranks and modes; a Linear that shares
    its weight with such an embedding and has no weight of its own stored is
    a tied head."""
    modules = dict(model.named_modules())
    cores: Dict[str, Dict[int, torch.Size]] = {}
    for key, t in state.items():
        m = _TT_KEY.match(key)
        if m and m.group(2) == "cores" and isinstance(t, torch.Tensor):
            cores.setdefault(m.group(1) or "", {})[int(m.group(3))] = t.shape
    layers = {}
    for name, shapes in cores.items():
        mod = modules.get(name)
        kind = ("TTEmbedding" if isinstance(mod, (nn.Embedding, TTEmbedding))
                else "TTLinear" if isinstance(mod, nn.Linear) or is_tt_layer(mod) else None)
        if kind is None or sorted(shapes) != list(range(len(shapes))):
            continue
        ordered = [shapes[k] for k in range(len(shapes))]
        layers[name] = {"type": kind, "ranks": [int(s[-1]) for s in ordered[:-1]],
                        "modes": [list(s[1:-1]) for s in ordered]}
    embeddings = {id(getattr(modules[n], "weight", None)): n for n, i in layers.items()
                  if i["type"] == "TTEmbedding" and isinstance(modules[n], nn.Embedding)}
    for name, mod in modules.items():
        if (type(mod) is nn.Linear and name not in layers and f"{name}.weight" not in state
                and id(mod.weight) in embeddings):
            layers[name] = {"type": "TiedTTLinear", "embedding": embeddings[id(mod.weight)]}
    return layers


# --------------------------------------------------------------- TT shapes
def modes_of(layer: nn.Module) -> List[List[int]]:
    return [list(c.shape[1:-1]) for c in layer.cores]


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Puts ``new`` wherever ``old`` sits; heads tied to ``old`` are tied to ``new``."""
    swap = {}
    for _, parent in list(model.named_modules()):
        for attr, child in list(parent._modules.items()):
            if child is old:
                setattr(parent, attr, new)
            elif isinstance(child, TiedTTLinear) and child.embedding is old:
                tied = swap.get(id(child))
                if tied is None:
                    tied = swap[id(child)] = TiedTTLinear(new, bias=child.bias)
                    tied.train(child.training)
                setattr(parent, attr, tied)


def _rebuilt(old: nn.Module, modes: List[List[int]]) -> Optional[nn.Module]:
    """``old`` with the recorded ``modes``, or None when these are not modes
    a resize gives (another number of cores, other dim or input modes)."""
    core = old.cores[0]
    factory = dict(device=core.device, dtype=core.dtype)
    if isinstance(old, TTEmbedding):
        if len(modes) != len(old.cores) or any(len(m) != 2 for m in modes):
            return None
        return TTEmbedding(old.num_embeddings, old.embedding_dim, rank=max(old.ranks),
                           shape=([m[0] for m in modes], [m[1] for m in modes]),
                           padding_idx=old.padding_idx, mode=old.mode,
                           include_last_offset=old.include_last_offset, reuse=old.reuse,
                           capturable=old.capturable, **factory)
    if isinstance(old, TTLinear):
        p = old.num_in_cores
        flat = [m[0] for m in modes]
        if len(modes) != len(old.cores) or flat[:p] != list(old.in_shape):
            return None
        out_shape = flat[p:]
        # built with the exact product of its output modes (no padding to check), then given
        # its output count: the grown leading mode pads, as resize_token_embeddings left it
        new = TTLinear(old.in_features, math.prod(out_shape), bias=False, rank=max(old.ranks),
                       in_shape=flat[:p], out_shape=out_shape, path=old.path, **factory)
        new.out_features = old.out_features
        new.bias = old.bias
        return new
    return None


def rebuild_shapes(model: nn.Module, layers: Dict[str, dict]) -> None:
    """Gives each recorded TT layer its recorded modes when the model built
    another factorisation: a resized vocabulary grows the leading row (or
    output) mode, which the default factorisation of the new size need not
    reproduce.  Heads tied to a rebuilt embedding are tied to the new one.
    Other mode differences are left to the load, which reports them."""
    modules = dict(model.named_modules())
    for name, info in layers.items():
        old = modules.get(name)
        if not is_tt_layer(old) or not info.get("modes") or modes_of(old) == info["modes"]:
            continue
        new = _rebuilt(old, info["modes"])
        if new is None:
            continue
        trainable = old.cores[0].requires_grad
        for q in list(new.cores) + list(new.gates):
            q.requires_grad_(trainable)
        new.train(old.training)
        _replace(model, old, new)


# ------------------------------------------------------------ mismatched sizes
def split_mismatched(model: nn.Module, state: Dict[str, torch.Tensor]) -> Set[Tuple[str, tuple, tuple]]:
    """Removes from ``state`` the tensors whose shape the model cannot take
    (a TT layer's cores and gates all together when its modes differ; ranks
    may differ, they follow the checkpoint) and returns them as transformers
    reports them: ``(name, stored shape, model shape)``."""
    mismatched = set()
    expected = model.state_dict(keep_vars=True)
    tt_names = set()
    for name, layer in tt_layers(model):
        prefix = f"{name}." if name else ""
        own = [k for k in state if k.startswith(prefix) and _OWN_KEY.fullmatch(k[len(prefix):])]
        tt_names.update(own)
        try:
            checkpoint_shapes(layer, state, prefix)
        except ValueError:
            for k in own:
                mine = tuple(expected[k].shape) if k in expected else ()
                mismatched.add((k, tuple(state.pop(k).shape), mine))
    for k in list(state):
        if k in tt_names or k not in expected or not isinstance(state[k], torch.Tensor):
            continue
        if tuple(state[k].shape) != tuple(expected[k].shape):
            mismatched.add((k, tuple(state.pop(k).shape), tuple(expected[k].shape)))
    return mismatched


# -------------------------------------------------------- weights not stored
def _init_std(config) -> float:
    for attr in ("initializer_range", "init_std", "initializer_factor"):
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 0.02


@torch.no_grad()
def _init_tt_layer(layer: nn.Module, std: float, keep: Set[int]) -> None:
    """A TT layer whose cores the checkpoint lacks: its own initialisation,
    cores scaled so the weight (table) has transformers' N(0, std^2) scale,
    bias zero; tensors in ``keep`` (loaded) are left alone."""
    saved = {id(p): p.detach().clone() for p in layer.parameters() if id(p) in keep}
    layer.reset_parameters()
    cores = list(layer.cores)
    current = float(layer.weight.detach().float().pow(2).mean())
    if current > 0:
        factor = (std * std / current) ** (1.0 / (2 * len(cores)))
        for c in cores:
            c.mul_(factor)
    if getattr(layer, "bias", None) is not None:
        layer.bias.zero_()
    for p in layer.parameters():
        if id(p) in saved:
            p.copy_(saved[id(p)])


def init_missing(model: nn.Module, loaded: Set[str]) -> None:
    """Initialises every parameter the checkpoint did not fill, as
    transformers does: loaded tensors are marked ``_is_hf_initialized`` and
    ``model.initialize_weights()`` (the model's ``_init_weights``) does the
    rest; TT layers, which ``_init_weights`` does not know, get their own
    initialisation scaled to the config's ``initializer_range``."""
    tensors = model.state_dict(keep_vars=True)
    done = {id(t) for name, t in tensors.items() if name in loaded}
    missing = [name for name, t in tensors.items() if id(t) not in done]
    if not missing:
        return
    std = _init_std(getattr(model, "config", None))
    for _, layer in tt_layers(model):
        if any(id(c) not in done for c in layer.cores):
            _init_tt_layer(layer, std, done)
            done.update(id(p) for p in layer.parameters())
    for t in tensors.values():
        if id(t) in done:
            t._is_hf_initialized = True
    # the build (on the meta device) marked every module initialised: a module with a
    # tensor the checkpoint lacks is not
    stored = {id(t) for t in tensors.values()}    # persistent tensors: what a checkpoint holds
    for module in model.modules():
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if any(id(t) in stored and id(t) not in done for t in own if t is not None):
            module._is_hf_initialized = False
    if callable(getattr(model, "initialize_weights", None)):
        model.initialize_weights()
    else:  # transformers 4: no flags, initialise only the modules with a missing tensor
        owners = {n.rsplit(".", 1)[0] if "." in n else "" for n in missing}
        for name, module in model.named_modules():
            if name in owners and not is_tt_layer(module):
                model._init_weights(module)


# ------------------------------------------------------------------- report
def report(model: nn.Module, path, info: dict, ignore_mismatched_sizes: bool) -> None:
    """transformers' loading report (its logger and format), which raises
    RuntimeError for mismatched sizes unless ``ignore_mismatched_sizes``."""
    try:
        from transformers import modeling_utils
        from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report
    except ImportError:  # pragma: no cover - other transformers versions
        if info["mismatched_keys"] and not ignore_mismatched_sizes:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}: size "
                               f"mismatch for {sorted(k for k, _, _ in info['mismatched_keys'])}; "
                               "you may pass ignore_mismatched_sizes=True") from None
        if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
            logger.warning("comera.from_pretrained %s: missing %s, unexpected %s, mismatched %s",
                           path, sorted(info["missing_keys"]), sorted(info["unexpected_keys"]),
                           sorted(info["mismatched_keys"]))
        return
    fields = dict(missing_keys=set(info["missing_keys"]), unexpected_keys=set(info["unexpected_keys"]),
                  mismatched_keys=set(info["mismatched_keys"]), error_msgs=list(info["error_msgs"]),
                  conversion_errors={})
    if "skipped_pp_keys" in inspect.signature(LoadStateDictInfo).parameters:
        fields["skipped_pp_keys"] = set()
    log_state_dict_report(model=model, pretrained_model_name_or_path=str(path),
                          ignore_mismatched_sizes=ignore_mismatched_sizes,
                          loading_info=LoadStateDictInfo(**fields), logger=modeling_utils.logger)

