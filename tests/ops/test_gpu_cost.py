"""The GPU cost model (comera.ops.gpu_cost): its launch counts against the
table that the CUDA emulation checks its own counts against
(tests/cuda_emu/launch_counts.txt), its FLOPs and bytes against sizes worked
out by hand, and TTEmbedding.plan(device="cuda")."""
import os

import pytest
import torch

import comera
from comera.ops import gpu_cost
from comera.ops.gpu_cost import (dense_linear_gpu_cost, launch_counts, tt_embedding_gpu_cost,
                                 tt_linear_gpu_cost)

TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda_emu",
                     "launch_counts.txt")


def table(op):
    """The table's cases of ``op``: dicts of int lists, as launch_table.h reads them."""
    cases = []
    with open(TABLE) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if not words or words[0] != op:
                continue
            case = {}
            for w in words[1:]:
                key, _, value = w.partition("=")
                case[key] = [int(x) for x in value.split(",")]
            cases.append(case)
    return cases


LINEAR = table("linear")
EMBEDDING = table("embedding")


def linear_cost(c, batch=None):
    # the emulation counts float32 calls (the padding step depends on the dtype)
    return tt_linear_gpu_cost(c["in"], c["out"], c["ranks"], c["features"][0], c["features"][1],
                              c["batch"][0] if batch is None else batch, torch.float32,
                              bias=bool(c["bias"][0]), input_grad=bool(c["dx"][0]))


def test_the_table_has_cases_of_both_ops():
    assert len(LINEAR) >= 5 and len(EMBEDDING) >= 4
    assert all(len(c["fwd"]) == 3 and len(c["bwd"]) == 3 for c in LINEAR + EMBEDDING)


@pytest.mark.parametrize("case", LINEAR, ids=lambda c: f"{c['in']}x{c['out']}b{c['batch'][0]}bias{c['bias'][0]}")
def test_linear_launches_match_the_emulation_table(case):
    assert launch_counts(linear_cost(case)) == case["fwd"] + case["bwd"]


@pytest.mark.parametrize("case", [c for c in LINEAR if c["batch"][0] > 0][:2],
                         ids=lambda c: f"{c['in']}x{c['out']}")
def test_linear_launches_do_not_depend_on_the_batch(case):
    assert launch_counts(linear_cost(case, batch=4096)) == case["fwd"] + case["bwd"]


@pytest.mark.parametrize("case", EMBEDDING, ids=lambda c: f"{c['rows']}n{c['n'][0]}")
def test_embedding_launches_match_the_emulation_table(case):
    mode = {0: "plain", 1: "sum", 2: "mean"}[case["mode"][0]]
    reuse = {0: "auto", 1: "none", 2: "dedup", 3: "prefix"}[case["reuse"][0]]
    cost = tt_embedding_gpu_cost(case["rows"], case["dims"], case["ranks"], case["features"][0],
                                 case["features"][1], case["n"][0], mode=mode,
                                 num_bags=case.get("bags", [0])[0], reuse=reuse)
    assert launch_counts(cost) == case["fwd"] + case["bwd"]


def test_linear_flops_and_bytes_of_the_large_products():
    # 768 -> 3072, rank 32 in the middle, 4096 rows of bfloat16, with bias
    c = tt_linear_gpu_cost([8, 8, 12], [12, 16, 16], [1, 8, 32, 32, 32, 16, 1], 768, 3072, 4096)
    blas = {k["name"]: k for k in c["kernels"] if k["kind"] == "blas"}
    assert blas["T = x V"]["flops"] == 2 * 4096 * 768 * 32
    # the bias rides as a 33rd rank, padded to 48 for the tensor cores
    assert blas["y = [T 1] [U; b]"]["flops"] == 2 * 4096 * 48 * 3072
    assert blas["y = [T 1] [U; b]"]["bytes"] == 2 * (4096 * 48 + 48 * 3072 + 4096 * 3072)
    assert blas["dx = S V^T"]["bytes"] == 2 * (4096 * 32 + 768 * 32 + 4096 * 768)
    # merge step 2, both chains in one launch: V's (8*8 x 32) times (32 x 12*32) and
    # U's (32*12*16 x 16) times (16 x 16*1)
    merge = [k for k in c["kernels"] if k["name"] == "merge step 2"][0]
    assert merge["flops"] == 2 * 64 * 32 * (12 * 32) + 2 * (32 * 12 * 16) * 16 * 16
    # the forward moves at least x and y once; everything adds up
    assert c["forward"]["bytes"] > 2 * 4096 * (768 + 3072)
    assert c["seconds"] == pytest.approx(sum(k["seconds"] for k in c["kernels"]))
    assert c["flops"] == pytest.approx(c["forward"]["flops"] + c["backward"]["flops"])


def test_each_launch_is_a_roofline_plus_the_launch_time():
    g = gpu_cost.GPUS["H100"]
    c = tt_linear_gpu_cost([4, 4], [4, 4], [1, 4, 8, 4, 1], 16, 16, 1 << 16, torch.float32,
                           gpu="H100")
    for k in c["kernels"]:
        rate = g.fp32  # float32 GEMMs without TF32 run on the CUDA cores
        assert k["seconds"] == pytest.approx(
            max(k["bytes"] / g.bandwidth, k["flops"] / rate) + g.launch_s)
    faster = tt_linear_gpu_cost([4, 4], [4, 4], [1, 4, 8, 4, 1], 16, 16, 1 << 16, torch.float32,
                                gpu="H100", tf32=True)
    assert faster["seconds"] <= c["seconds"]


def test_rates_and_devices():
    args = ([8, 8, 12], [12, 16, 16], [1, 8, 32, 32, 32, 16, 1], 768, 3072, 4096)
    h100, h200 = (tt_linear_gpu_cost(*args, gpu=g) for g in ("H100", "H200"))
    assert h200["seconds"] < h100["seconds"]  # same FLOP rates, more bandwidth
    assert h100["bytes"] == h200["bytes"] and h100["flops"] == h200["flops"]
    f32 = tt_linear_gpu_cost(*args, dtype=torch.float32)
    assert f32["bytes"] > h200["bytes"] and f32["seconds"] > h200["seconds"]
    assert gpu_cost.gpu_spec("NVIDIA H200") is gpu_cost.GPUS["H200"]
    with pytest.raises(ValueError, match="gpu must be one of"):
        gpu_cost.gpu_spec("A100")
    with pytest.raises(TypeError, match="dtype"):
        tt_linear_gpu_cost(*args, dtype=torch.int32)
    with pytest.raises(ValueError, match="ranks"):
        tt_linear_gpu_cost([8], [12], [1, 4], 8, 12, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [1, 8, 16, 30, 31, 32, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_the_rank_is_padded_for_aligned_products(dtype, rank, bias):
    # 768 -> 3072: only the rank (and the bias riding as one more) can be odd
    c = tt_linear_gpu_cost([8, 8, 12], [12, 16, 16], [1, 8, rank, rank, rank, 16, 1], 768, 3072,
                           4096, dtype, bias=bias)
    assert c["forward"]["unaligned_blas"] == c["backward"]["unaligned_blas"] == 0
    step = 32 // dtype.itemsize
    blas = {k["name"]: k for k in c["kernels"] if k["kind"] == "blas"}
    rp, rk = (-(-n // step) * step for n in (rank, rank + bias))
    assert blas["y = [T 1] [U; b]"]["flops"] == 2 * 4096 * rk * 3072
    assert blas["dx = S V^T"]["flops"] == 2 * 4096 * rp * 768
    copies = [k["name"] for k in c["kernels"] if k["kind"] == "copy"]
    assert ("t from the padded T" in copies) == (rk != rank)
    assert ("dV from the padded product" in copies) == (rp != rank)


def test_unaligned_features_are_flagged():
    c = tt_linear_gpu_cost([3, 5], [2, 3, 2], [1, 3, 4, 4, 2, 1], 13, 11, 64, torch.float32)
    unaligned = sorted(k["name"] for k in c["kernels"] if not k.get("aligned", True))
    assert unaligned == ["S = dy U^T", "T = x V", "[dU; db] = [t 1]^T dy", "dV = x^T S",
                         "dx = S V^T", "y = [T 1] [U; b]"]


def test_dense_linear():
    c = dense_linear_gpu_cost(768, 3072, 4096, torch.bfloat16)
    assert c["flops"] == pytest.approx(6 * 4096 * 768 * 3072, rel=1e-3)
    assert launch_counts(c) == [0, 1, 0, 1, 2, 0]
    assert launch_counts(dense_linear_gpu_cost(8, 8, 4, bias=False, input_grad=False)) == \
        [0, 1, 0, 0, 1, 0]


def test_embedding_sort_choice_follows_reuse():
    args = ([37, 25, 33], [8, 8, 12], [1, 32, 32, 1], 30522, 768, 100)
    assert tt_embedding_gpu_cost(*args, reuse="auto")["reuse"] == "dedup"  # rows are costly
    assert tt_embedding_gpu_cost(*args, reuse="none")["reuse"] == "none"
    cheap = tt_embedding_gpu_cost([5, 3], [2, 3], [1, 3, 1], 15, 6, 9)
    assert cheap["reuse"] == "none"
    with pytest.raises(ValueError, match="mode"):
        tt_embedding_gpu_cost(*args, mode="max")


def test_ttembedding_plan_for_cuda():
    emb = comera.TTEmbedding(30522, 768, rank=32)
    idx = torch.randint(0, 30522, (32, 128))
    plan = emb.plan(idx, device="cuda", gpu="H100")
    want = tt_embedding_gpu_cost(emb.row_shape, emb.dim_shape, [1] + emb.ranks + [1], 30522, 768,
                                 4096, gpu="H100")
    assert plan["kernels"] == want["kernels"] and plan["n"] == 4096
    # 4096 indices: the sort is a chunk-rank launch and 2 merge passes
    assert plan["forward"]["launches"]["kernel"] == 12
    assert [k["name"] for k in plan["kernels"] if "sort" in k["name"] and k["phase"] == "forward"] \
        == ["index sort chunk ranks", "index sort merge pass 1", "index sort merge pass 2"]
    bags = comera.TTEmbedding(100, 8, rank=2, mode="sum").plan(torch.zeros(3, 5, dtype=torch.long),
                                                                device="cuda")
    assert bags["mode"] == "sum" and any(k["name"] == "bags" for k in bags["kernels"])
    assert "unique" in emb.plan(idx)  # the CPU planner, as before
