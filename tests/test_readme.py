"""The README's Python examples run as written: its ``python`` blocks in
order, in one namespace, with a small model and data standing in for the
user's own (``MyNet``, ``data``, ``loss_fn``)."""
import os
import re

import pytest
import torch
from torch import nn

import comera

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks():
    with open(README) as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), re.S)


def _my_net():
    return nn.Sequential(comera.TTLinear(16, 32, rank=4), nn.ReLU(), comera.TTLinear(32, 4, rank=4))


def test_readme_has_the_examples_it_promises():
    blocks = _blocks()
    assert len(blocks) == 3
    assert "comera.TTLinear(768, 3072, rank=30)" in blocks[0]
    assert "comera.convert(model, rank=32)" in blocks[1]
    assert "comera.RankAdaptive(" in blocks[2]


def test_readme_examples_run():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
    ns = {"MyNet": _my_net, "data": data, "loss_fn": nn.functional.mse_loss}
    quick, convert, adapt = _blocks()
    exec(compile(quick, "README.md python block 0", "exec"), ns)
    # what each block leaves behind is what its comments say
    assert ns["y"].shape == (32, 128, 3072)
    assert all(p.grad is not None for p in ns["layer"].parameters())
    assert isinstance(ns["dense"], nn.Linear) and isinstance(ns["tt"], comera.TTLinear)
    assert ns["out"].shape == (1, 3, 768)
    exec(compile(convert, "README.md python block 1", "exec"), ns)
    assert not any(type(m) is nn.Linear for m in ns["model"].modules())
    assert any(isinstance(m, comera.TTEmbedding) for m in ns["model"].modules())
    exec(compile(adapt, "README.md python block 2", "exec"), ns)
    assert ns["ra"].state_dict()["step"] == len(data)  # the hook ran inside opt.step()
