"""Everything comera writes to or reads from disk, in one place.

* :func:`atomic_write`: crash-safe writes.  A file is written to a temporary
  file in the destination's directory, flushed and fsynced, then moved over
  the destination with ``os.replace`` (atomic on POSIX and Windows within
  one file system), and the directory entry is fsynced too; a crash or an
  exception while writing keeps the previous file and removes the temporary.
* :func:`load_state_dict`: loads a state_dict whose TT ranks differ from
  the model's (pruned models).  Plain ``model.load_state_dict(sd)`` already
  works: every TT layer resizes its cores and gates to the checkpoint's
  ranks before they are copied in (:class:`comera.layers.base.TTLayerMixin`);
  this function checks every layer first and raises a ValueError naming the
  layer instead of load_state_dict's collected RuntimeError.
* :func:`save` / :func:`load` (``comera.save`` / ``comera.load``):
  safetensors files that record each TT layer's ranks, so a rank-pruned
  model reloads into a freshly converted one.  The file is a plain
  safetensors file holding ``model.state_dict()``; tensors that are one
  shared Parameter (tied weights) are stored once.  Its string metadata
  holds ``comera.layers`` (JSON: per TT layer its type, ranks, live ranks
  and mode sizes), ``comera.aliases`` (JSON: dropped name -> stored name)
  and ``comera.version``.  safetensors is imported lazily (it is in the
  ``train`` extra), so ``import comera`` needs only torch.
* Training checkpoints (``comera pretrain``): :func:`save_training_state`,
  :func:`load_training_state`, :func:`rng_state` / :func:`set_rng_state`;
  the model part is loaded with :func:`load_state_dict`, which resizes
  pruned TT layers first.
"""
import json
import os
import random
import tempfile
from typing import Callable, Dict, Mapping, Optional, Union

import torch
from torch import nn

from comera._version import __version__
from comera.layers.base import checkpoint_shapes, live_ranks, resize_to_checkpoint, tt_layers

PathLike = Union[str, "os.PathLike[str]"]


# -------------------------------------------------------------- atomic writes
def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse it
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp_path)`` to produce the file, then moves it to ``path``.

    ``write`` gets the name of an empty temporary file next to ``path`` and
    must write the whole content there (``torch.save(obj, tmp_path)``,
    ``safetensors.torch.save_file(d, tmp_path)``...).  ``path`` is replaced
    only once the new content is complete and on disk.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
        >>> def write(tmp):
        ...     with open(tmp, "w") as f:
        ...         f.write("hello")
        >>> atomic_write(path, write)
        >>> with open(path) as f:
        ...     f.read()
        'hello'
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file private (0600), and some writers recreate
        # it: give it the mode the old file had, or the usual 0644
        mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def write_text(path: PathLike, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`).

    Example:
        >>> import os, pathlib, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "report.md")
        >>> write_text(path, "# title")
        >>> pathlib.Path(path).read_text()
        '# title'
    """
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    atomic_write(path, write)


def write_json(path: PathLike, data, *, indent: int = 1, sort_keys: bool = False) -> None:
    """Writes ``data`` as JSON, with a final newline, to ``path`` atomically.

    Example:
        >>> import json, os, pathlib, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.json")
        >>> write_json(path, {"loss": 1.5})
        >>> json.loads(pathlib.Path(path).read_text())
        {'loss': 1.5}
    """
    write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


def write_figure(path: PathLike, figure) -> None:
    """Saves a matplotlib ``figure`` to ``path`` atomically, in the format its
    extension names."""
    fmt = os.path.splitext(os.fspath(path))[1].lstrip(".") or None
    atomic_write(path, lambda tmp: figure.savefig(tmp, format=fmt))


# ------------------------------------------- state_dicts with other TT ranks
def load_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Loads ``state_dict`` into ``model``, resizing TT ranks to the checkpoint's.

    Returns what :meth:`torch.nn.Module.load_state_dict` returns (missing
    and unexpected keys).  Raises ValueError naming the layer when a TT
    layer's checkpoint has other mode sizes or another number of cores.
    After loading, recreate (or reload the state of) any optimizer built for
    the model's previous shapes.

    Example:
        >>> import torch, comera
        >>> small = comera.TTLinear(64, 64, rank=8)
        >>> with torch.no_grad():
        ...     small.gates[2][2:] = 0
        >>> _ = comera.prune(small)
        >>> fresh = comera.TTLinear(64, 64, rank=8)
        >>> _ = comera.load_state_dict(fresh, small.state_dict())
        >>> fresh.ranks
        [4, 8, 2, 8, 4]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError("load_state_dict: state_dict must be a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}")
    layers = [(layer, f"{name}." if name else "") for name, layer in tt_layers(model)]
    for layer, prefix in layers:
        checkpoint_shapes(layer, state_dict, prefix)  # raises, naming the layer; nothing resized yet
    for layer, prefix in layers:
        # TTLayerMixin layers would resize themselves; duck-typed ones need it done here
        resize_to_checkpoint(layer, state_dict, prefix)
    return model.load_state_dict(state_dict, strict=strict)


# --------------------------------------------- comera.save / comera.load
def _layer_info(layer: nn.Module) -> dict:
    cores = list(layer.cores)
    return {
        "type": type(layer).__name__,
        "ranks": [int(c.shape[-1]) for c in cores[:-1]],
        "live_ranks": live_ranks(layer),
        "modes": [list(c.shape[1:-1]) for c in cores],
    }


def import_safetensors():
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("comera.save/load need the safetensors package: "
                          "pip install safetensors (or comera[train])") from err
    return safetensors.torch, safe_open


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def save(model: nn.Module, path: PathLike, *, metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes ``model.state_dict()`` to a safetensors file with the TT ranks in its metadata.

    Tensors that share one storage (tied weights) are written once and
    re-linked by :func:`load`; every tensor is written from the CPU.
    ``metadata`` adds your own string entries (keys must not start with
    ``comera.``).

    Example:
        >>> import os, tempfile, torch, comera
        >>> net = comera.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), rank=4)
        >>> path = os.path.join(tempfile.mkdtemp(), "net.safetensors")
        >>> comera.save(net, path)
        >>> fresh = comera.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), rank=4)
        >>> x = torch.randn(2, 64)
        >>> torch.equal(comera.load(fresh, path)(x), net(x))
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save: model must be an nn.Module, got {type(model).__name__}")
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("save: metadata must be a mapping of str to str")
        bad = [k for k in metadata if k.startswith("comera.")]
        if bad:
            raise ValueError(f"save: metadata keys starting with 'comera.' are reserved, got {bad}")
    st, _ = import_safetensors()
    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    first_of: Dict[tuple, str] = {}   # storage -> first name stored from it
    state = model.state_dict()
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save: state_dict entry '{name}' is a {type(t).__name__}, not a tensor")
        key = _storage_key(t) if t.numel() > 0 else None
        first = first_of.get(key) if key is not None else None
        if first is None:
            if key is not None:
                first_of[key] = name
            tensors[name] = t.detach().to("cpu").contiguous()
            continue
        ref = state[first]
        if (t.shape, t.stride(), t.storage_offset(), t.dtype) == \
                (ref.shape, ref.stride(), ref.storage_offset(), ref.dtype):
            aliases[name] = first           # one Parameter under two names (tied weights)
        else:
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()  # another view: own copy
    info = {name: _layer_info(layer) for name, layer in tt_layers(model)}
    meta = {"format": "pt", "comera.version": __version__, "comera.layers": json.dumps(info),
            "comera.aliases": json.dumps(aliases)}
    meta.update(metadata or {})
    # written next to path and moved over it: a failed save keeps the old file
    atomic_write(path, lambda tmp: st.save_file(tensors, tmp, metadata=meta))


def read_metadata(path: PathLike) -> Dict[str, object]:
    """The comera metadata of a file written by :func:`save`: ``{"layers":
    {name: {"type", "ranks", "live_ranks", "modes"}}, "aliases": {...},
    "version": str, "user": {other keys}}``.

    Example:
        >>> import os, tempfile, torch, comera
        >>> path = os.path.join(tempfile.mkdtemp(), "l.safetensors")
        >>> comera.save(comera.TTLinear(64, 64, rank=4), path)
        >>> comera.storage.read_metadata(path)["layers"][""]["ranks"]
        [4, 4, 4, 4, 4]
    """
    _, safe_open = import_safetensors()
    with safe_open(os.fspath(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    return {
        "layers": json.loads(meta.pop("comera.layers", "{}")),
        "aliases": json.loads(meta.pop("comera.aliases", "{}")),
        "version": meta.pop("comera.version", None),
        "user": meta,
    }


def _is_zip(path: PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"PK"


def _read(path_or_state: Union[PathLike, Mapping[str, torch.Tensor]]):
    if isinstance(path_or_state, Mapping):
        return dict(path_or_state), {}
    path = os.fspath(path_or_state)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load: no checkpoint file at {path!r}")
    if _is_zip(path):  # torch.save(model.state_dict(), path)
        sd = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(sd, Mapping):
            raise TypeError(f"load: {path!r} holds a {type(sd).__name__}, expected a state_dict")
        return dict(sd), {}
    st, _ = import_safetensors()
    sd = st.load_file(path, device="cpu")
    meta = read_metadata(path)
    for alias, first in meta["aliases"].items():
        sd[alias] = sd[first]
    return sd, meta["layers"]


def _check_tt_places(model: nn.Module, layers_meta: dict) -> None:
    """Every TT layer recorded in the file must be a TT layer in the model."""
    mods = dict(model.named_modules())
    for name, info in layers_meta.items():
        m = mods.get(name)
        if m is None or not isinstance(getattr(m, "cores", None), nn.ParameterList):
            found = "nothing" if m is None else type(m).__name__
            raise ValueError(f"load: the checkpoint holds a {info.get('type', 'TT layer')} at "
                             f"'{name or '<model>'}' (ranks {info.get('ranks')}) but the model has "
                             f"{found} there: convert the model first (comera.convert with the "
                             "arguments used before saving)")


def load(model: nn.Module, path: Union[PathLike, Mapping[str, torch.Tensor]], *,
         strict: bool = True) -> nn.Module:
    """Loads a checkpoint into ``model`` (in place) and returns ``model``.

    ``path`` is a file written by :func:`save`, a ``torch.save(model.state_dict())``
    file (read with ``weights_only=True``), or a state_dict.  TT layers take
    the checkpoint's ranks first (the Parameter objects stay, their shapes
    change), so a model pruned before saving reloads into a freshly converted
    one; build the optimizer after loading.  Raises ValueError naming the
    layer when the checkpoint does not fit (a TT layer where the model is
    still dense, other mode sizes), and RuntimeError for missing/unexpected
    keys when ``strict``.

    Example:
        >>> import os, tempfile, torch, comera
        >>> path = os.path.join(tempfile.mkdtemp(), "l.safetensors")
        >>> small = comera.TTLinear(64, 64, rank=2)
        >>> comera.save(small, path)
        >>> comera.load(comera.TTLinear(64, 64, rank=8), path).ranks
        [2, 2, 2, 2, 2]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load: model must be an nn.Module, got {type(model).__name__}")
    sd, layers_meta = _read(path)
    _check_tt_places(model, layers_meta)
    load_state_dict(model, sd, strict=strict)   # resizes TT ranks first (comera.load_state_dict)
    return model


# --------------------------------------------------------- training checkpoints
def save_training_state(path: PathLike, state: dict) -> None:
    """Writes a training checkpoint (model, optimizer, schedule, RNG states,
    step, history, controller state: plain containers of tensors and
    numbers) with ``torch.save``, atomically: a crash or an error while
    saving never leaves a torn file and keeps the previous checkpoint.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "run", "checkpoint.pt")
        >>> save_training_state(path, {"step": 3, "w": torch.ones(2)})
        >>> load_training_state(path)["step"]
        3
    """
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path: PathLike) -> dict:
    """Reads a checkpoint of :func:`save_training_state` on the CPU.  Our own
    checkpoints hold plain containers of tensors and numbers, so
    ``weights_only=True`` loads them and never runs code from the file."""
    return torch.load(path, map_location="cpu", weights_only=True)


def tt_shapes(model: nn.Module) -> Dict[str, list]:
    """Stored ranks of every TT layer: ``{name: [r_1, ..., r_{D-1}]}``.

    Example:
        >>> import comera
        >>> tt_shapes(nn.Sequential(nn.Linear(4, 4), comera.TTLinear(64, 64, rank=4)))
        {'1': [4, 4, 4, 4, 4]}
    """
    return {name: [int(g.numel()) for g in layer.gates] for name, layer in tt_layers(model)}


def tt_live_ranks(model: nn.Module) -> Dict[str, list]:
    """Live ranks (non-zero gate entries) of every TT layer, by name."""
    return {name: live_ranks(layer) for name, layer in tt_layers(model)}


def rng_state() -> dict:
    """The torch, Python (and CUDA, when present) RNG states, for a resume
    that draws the same numbers."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restores :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
