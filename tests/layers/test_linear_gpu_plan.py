"""TTLinear.plan(device="cuda"): the GPU cost model of comera.ops.gpu_cost
for the layer, and the examples of docs/gpu_cost.md, which show it."""
import doctest
import os

import pytest
import torch

import comera
from comera.ops import gpu_cost
from comera.ops.gpu_cost import dense_linear_gpu_cost, tt_linear_gpu_cost

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "gpu_cost.md")


def test_ttlinear_plan_for_cuda():
    layer = comera.TTLinear(768, 3072, rank=32)
    plan = layer.plan(4096, torch.bfloat16, device="cuda", gpu="H200")
    want = tt_linear_gpu_cost(layer.in_shape, layer.out_shape, [1] + layer.ranks + [1], 768,
                              3072, 4096, torch.bfloat16, gpu="H200")
    assert plan["device"] == "cuda" and plan["path"] == "merge"
    assert plan["seconds"] == want["seconds"] and plan["kernels"] == want["kernels"]
    assert plan["dense"]["seconds"] == dense_linear_gpu_cost(768, 3072, 4096)["seconds"]
    assert plan["x_vs_dense"] == pytest.approx(plan["dense"]["seconds"] / plan["seconds"])
    # float32 pads the rank to 8: rank 8 without a bias needs no copy, rank 4 one each way
    nobias = comera.TTLinear(64, 32, bias=False, rank=8).plan(8, device="cuda", gpu="H100")
    assert nobias["forward"]["launches"]["copy"] == 0 and nobias["dtype"] == "float32"
    assert nobias["gpu"] == gpu_cost.GPUS["H100"].name
    small = comera.TTLinear(64, 32, bias=False, rank=4).plan(8, device="cuda", gpu="H100")
    assert small["forward"]["launches"]["copy"] == small["backward"]["launches"]["copy"] == 1
    assert "kernel" in layer.plan(4096)  # the CPU planner, as before


def test_the_docs_page_examples_run():
    path = DOCS
    with open(path) as f:  # the code fences end the examples
        text = "".join("\n" if line.startswith("```") else line for line in f)
    test = doctest.DocTestParser().get_doctest(text, {}, "gpu_cost.md", path, 0)
    assert test.examples
    result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS).run(test)
    assert result.failed == 0
