"""Large CPU outputs of the ops get transparent-huge-page advice before the
kernel writes them (csrc/common/pages.c, docs/design.md section 5).  The
advice must not change a single result, must switch off under
COMERA_HUGE_PAGES=0, and (where the kernel's THP mode lets madvise act) must
cut the first-touch page faults of a fresh 48 MB output."""
import os
import resource
import sys

import pytest
import torch

import comera


@pytest.fixture
def advice_env(monkeypatch):
    # the advice is for outputs from torch's allocator: with the output pool
    # on, a repeated call reuses an already mapped block (tests/ops/test_output_pool.py);
    # monkeypatch puts both variables back after the test
    monkeypatch.setenv("COMERA_OUTPUT_POOL", "0")
    monkeypatch.delenv("COMERA_HUGE_PAGES", raising=False)


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1: text.index("]")]


def _step(layer, x, gy):
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    y = layer(x)
    y.backward(gy)
    return y.detach(), x.grad.clone(), [c.grad.clone() for c in layer.cores]


def test_outputs_equal_with_and_without_advice(advice_env):
    # 4096 x 3072 float32 = 48 MB y, 12 MB dx: both over the 4 MB threshold
    layer = comera.TTLinear(768, 3072, rank=8)
    x = torch.randn(4096, 768, requires_grad=True)
    gy = torch.randn(4096, 3072)
    os.environ["COMERA_HUGE_PAGES"] = "1"
    y1, dx1, dc1 = _step(layer, x, gy)
    os.environ["COMERA_HUGE_PAGES"] = "0"
    y0, dx0, dc0 = _step(layer, x, gy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(torch.equal(a, b) for a, b in zip(dc1, dc0))
    # and both are right: y = x W^T + b and dx = gy W, with W merged from
    # the cores by torch (tt.merge, not the C kernels), in float64
    wt = layer.weight.detach().double().t()
    ref_y = x.detach().double() @ wt + layer.bias.detach().double()
    ref_dx = gy.double() @ wt.t()
    assert torch.allclose(y1.double(), ref_y, rtol=1e-4, atol=1e-4)
    assert torch.allclose(dx1.double(), ref_dx, rtol=1e-4, atol=1e-4)

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")
def test_advice_cuts_first_touch_faults(advice_env):
    mode = _thp_mode()
    layer = comera.TTLinear(768, 3072, rank=8)
    x = torch.randn(4096, 768)
    pages_4k = 4096 * 3072 * 4 // 4096  # 12288 first-touch faults without huge pages

    def forward_faults():
        with torch.no_grad():
            layer(x)  # warm-up: plans, code pages, torch's own buffers
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            y = layer(x)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del y
        return faults

    os.environ["COMERA_HUGE_PAGES"] = "1"
    with_advice = forward_faults()
    if mode in ("always", "madvise"):
        # 2 MB pages: ~24 faults plus the unaligned ends (at most ~1000 4 KB pages)
        assert with_advice < pages_4k // 4, (mode, with_advice)
    else:
        # THP off (or absent): the advice is a harmless no-op
        assert with_advice <= 2 * pages_4k, (mode, with_advice)
