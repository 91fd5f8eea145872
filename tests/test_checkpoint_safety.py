"""Checkpoint safety: comera.save / comera.load and the pre-training
checkpoints (comera.storage) keep the previous file when a save
fails half-way, leave no temporary file behind, never run code from a file
(no unpickling of arbitrary objects), and refuse checkpoints that do not fit
the model with a message naming what is wrong."""
import os
import pickle

import pytest
import torch
from torch import nn

import comera
from comera import storage


def _net(rank=4):
    torch.manual_seed(0)
    return comera.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)), rank=rank)


def _files(d):
    return sorted(os.listdir(d))


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "net.safetensors"
    net = _net()
    comera.save(net, path)
    before = path.read_bytes()
    x = torch.randn(3, 64)
    want = net(x)

    real = st.save_file

    def torn(tensors, filename, metadata=None):
        # write part of a file, then fail, as a full disk or a kill would
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise OSError("disk full (simulated)")

    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # the failed save would have written different values
    monkeypatch.setattr(st, "save_file", torn)
    with pytest.raises(OSError, match="simulated"):
        comera.save(net, path)
    assert path.read_bytes() == before
    assert _files(tmp_path) == ["net.safetensors"]          # no temp file left
    fresh = _net()
    torch.testing.assert_close(comera.load(fresh, path)(x), want)


def test_save_replaces_atomically_and_keeps_mode(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "net.safetensors"
    comera.save(_net(), path)
    os.chmod(path, 0o640)
    comera.save(_net(rank=2), path)
    assert _files(tmp_path) == ["net.safetensors"]
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert comera.load(_net(), path)[0].ranks == [2, 2, 2, 2, 2]


def test_pretrain_checkpoint_failed_save_keeps_previous(tmp_path, monkeypatch):
    path = str(tmp_path / "run" / "ckpt.pt")
    storage.save_training_state(path, {"step": 1, "w": torch.arange(4.0)})
    before = open(path, "rb").read()
    real = torch.save

    def torn(obj, f, *a, **kw):
        real(obj, f, *a, **kw)
        with open(f, "r+b") as fh:
            fh.truncate(10)
        raise KeyboardInterrupt  # an interrupt mid-save

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        storage.save_training_state(path, {"step": 2, "w": torch.zeros(4)})
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert _files(tmp_path / "run") == ["ckpt.pt"]
    state = storage.load_training_state(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(4.0))


class _Payload:
    """Unpickling this object would run code (sets a module attribute)."""

    def __reduce__(self):
        return (exec, ("import builtins; builtins._comera_pwned = True",))


def _evil_file(path):
    torch.save({"0.cores.0": torch.zeros(1), "payload": _Payload()}, path)


def test_load_never_unpickles_code(tmp_path):
    import builtins
    path = tmp_path / "evil.pt"
    _evil_file(path)
    with pytest.raises(pickle.UnpicklingError):
        comera.load(_net(), path)
    with pytest.raises(pickle.UnpicklingError):
        storage.load_training_state(str(path))
    assert not hasattr(builtins, "_comera_pwned")


def test_pretrain_checkpoint_roundtrip_weights_only(tmp_path):
    """The real training state (optimizer, RNG, controller) loads with
    weights_only=True."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(2, 64)).sum().backward()
    opt.step()
    ctl = comera.RankAdaptive(net, gamma=1e-3, threshold=1e-3, stage1_steps=2, stage2_steps=2,
                              target_compression=2.0)
    state = {"model": net.state_dict(), "optimizer": opt.state_dict(),
             "controller": ctl.state_dict(), "rng": storage.rng_state(),
             "history": {"loss": [(0, 1.5)]}, "preset": {"name": "tiny"}, "step": 3}
    path = str(tmp_path / "ckpt.pt")
    storage.save_training_state(path, state)
    back = storage.load_training_state(path)
    assert back["step"] == 3 and back["rng"]["python"] == state["rng"]["python"]
    assert back["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()


def test_load_refuses_missing_keys(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "net.safetensors"
    comera.save(_net(), path)
    bigger = nn.Sequential(*_net(), nn.Linear(32, 8))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"3.weight\", "
                                           r"\"3.bias\""):
        comera.load(bigger, path)


def test_load_refuses_mismatched_dense_shape(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "net.safetensors"
    net = comera.convert(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)), rank=4)
    comera.save(net, path)
    other = comera.convert(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)), rank=4)
    other[1] = nn.LayerNorm(32)
    with pytest.raises(RuntimeError, match=r"size mismatch for 1.weight: copying a param with "
                                           r"shape torch.Size\(\[64\]\)"):
        comera.load(other, path)


def test_load_refuses_other_tt_modes(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "l.safetensors"
    comera.save(comera.TTLinear(64, 64, rank=4, in_shape=[8, 8], out_shape=[8, 8]), path)
    with pytest.raises(ValueError, match=r"core 0 has shape \(1, 8, 4\) in the checkpoint, the "
                                         r"layer.s is \(1, 4, 4\)"):
        comera.load(comera.TTLinear(64, 64, rank=4, in_shape=[4, 16], out_shape=[8, 8]), path)


def test_load_refuses_tt_checkpoint_into_dense_model(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "net.safetensors"
    comera.save(_net(), path)
    dense = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with pytest.raises(ValueError, match=r"TTLinear at '0'.*convert the model first"):
        comera.load(dense, path)
