"""The C kernels' micro-kernel variants from Python: torch.ops.comera.cpu_isa()
names the one in use, COMERA_ISA forces one (read once per process, so each
case runs in a fresh interpreter), and every variant this CPU runs gives the
same TTLinear values and gradients."""
import json
import os
import subprocess
import sys

import pytest
import torch

import comera  # noqa: F401  (loads the operators)

VARIANTS = ("avx512", "avx2", "generic")

# One forward+backward of a TTLinear on the merge and sequential paths,
# printed as JSON with the variant that ran.
_CHILD = r"""
import json, sys, torch, comera
torch.manual_seed(0)
out = {"isa": torch.ops.comera.cpu_isa()}
for path in ("merge", "sequential"):
    layer = comera.TTLinear(96, 200, rank=[4, 9, 11, 7, 8], in_shape=[4, 4, 6],
                            out_shape=[5, 5, 8], path=path)
    x = torch.randn(50, 96, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    out[path] = [y.detach().flatten().tolist()] + [g.flatten().tolist() for g in grads]
print(json.dumps(out))
"""


def _run(isa):
    env = dict(os.environ, COMERA_ISA=isa, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_cpu_isa_names_a_variant():
    assert torch.ops.comera.cpu_isa() in VARIANTS


def test_unknown_isa_falls_back_with_a_warning():
    out, err = _run("no-such-isa")
    assert out["isa"] in VARIANTS
    assert "COMERA_ISA=no-such-isa" in err and f"using {out['isa']}" in err


def test_every_runnable_variant_agrees():
    auto, _ = _run("auto")
    ran = {}
    for isa in VARIANTS:
        out, err = _run(isa)
        if out["isa"] != isa:
            # this CPU cannot run it: the fallback is announced, never silent
            assert "cannot run it" in err, err
            continue
        ran[isa] = out
    assert auto["isa"] in ran and "generic" in ran
    for isa, out in ran.items():
        for path in ("merge", "sequential"):
            for got, want in zip(out[path], ran["generic"][path]):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want),
                                           rtol=1e-4, atol=1e-5, msg=f"{isa} {path}")
