import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera
from comera.ops.dense import ttm_full
from comera.ops.dense import ttm_table
from reference_embedding import dense_ttm_by_entries

# num_embeddings, embedding_dim, shape (row_modes, dim_modes), rank
CASES = [
    (6, 4, ([2, 3], [2, 2]), 2),                      # d = 2
    (20, 9, ([3, 2, 4], [3, 1, 3]), 3),               # padded rows, a dim mode of 1
    (23, 10, ([2, 3, 4], [2, 3, 2]), [2, 5]),         # padded rows and dims
    (16, 8, ([2, 2, 2, 2], [2, 2, 1, 2]), 100),       # d = 4, ranks at the TT bound
    (7, 5, ([7, 1], [5, 1]), 1),                      # rank 1, trivial modes
    (24, 32, ([3, 2, 4], [4, 2, 4]), 8),              # narrow last dim mode: transposed last level
]
IDS = [f"{c[0]}x{c[1]}-d{len(c[2][0])}" for c in CASES]
REUSES = ["none", "dedup", "prefix", "auto"]


def _make(num, dim, shape, rank, dtype=torch.float64, **kw):
    emb = comera.TTEmbedding(num, dim, rank=rank, shape=shape, dtype=dtype, **kw)
    with torch.no_grad():  # gates away from 1 so gate gradients matter
        for g in emb.gates:
            g.uniform_(0.5, 1.5)
    return emb


def _reference(emb):
    """Detached copies of the parameters and the table built from them entry by entry."""
    cores = [c.detach().clone().requires_grad_() for c in emb.cores]
    gates = [g.detach().clone().requires_grad_() for g in emb.gates]
    table = dense_ttm_by_entries(cores, gates, emb.num_embeddings, emb.embedding_dim)
    if emb.padding_idx is not None:
        keep = torch.ones(emb.num_embeddings, 1, dtype=table.dtype)
        keep[emb.padding_idx] = 0
        table = table * keep
    return table, cores, gates


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-10)


def _check_grads(emb, cores, gates, dtype):
    for c, cr in zip(emb.cores, cores):
        torch.testing.assert_close(c.grad, cr.grad, **_tol(dtype))
    for g, gr in zip(emb.gates, gates):
        torch.testing.assert_close(g.grad, gr.grad, **_tol(dtype))


def _indices(num, shape, repeat_from=None):
    if repeat_from is None:
        return torch.randint(0, num, shape)
    return torch.tensor(repeat_from)[torch.randint(0, len(repeat_from), shape)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reuse", REUSES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_lookup_matches_dense_reference(case, reuse, dtype):
    num, dim, shape, rank = case
    emb = _make(num, dim, shape, rank, dtype, reuse=reuse)
    table, cores, gates = _reference(emb)
    for idx in (_indices(num, (37,)), _indices(num, (5, 9)), _indices(num, (300,), [num - 1, 0, 3 % num])):
        emb.zero_grad()
        for t in cores + gates:
            t.grad = None
        y = emb(idx)
        yr = table[idx]
        assert y.shape == idx.shape + (dim,)
        torch.testing.assert_close(y, yr, **_tol(dtype))
        g = torch.randn_like(y)
        (y * g).sum().backward()
        (yr * g).sum().backward(retain_graph=True)  # the table is shared by the loop
        _check_grads(emb, cores, gates, dtype)


@pytest.mark.parametrize("reuse", REUSES)
def test_padding_idx_rows_are_zero_and_give_no_gradient(reuse):
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3, padding_idx=-3, reuse=reuse)
    assert emb.padding_idx == 20
    idx = torch.tensor([[20, 1, 20, 5], [5, 20, 22, 0]])
    table, cores, gates = _reference(emb)
    y = emb(idx)
    assert torch.all(y[idx == 20] == 0)
    torch.testing.assert_close(y, table[idx])
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (table[idx] * g).sum().backward()
    _check_grads(emb, cores, gates, torch.float64)
    # only padding: no gradient at all
    emb.zero_grad()
    emb(torch.full((6,), 20)).sum().backward()
    assert all(torch.all(p.grad == 0) for p in emb.parameters())
    assert torch.all(emb.weight[20] == 0) and emb.to_dense().padding_idx == 20


def _bag_cases(num):
    offsets = torch.tensor([0, 0, 3, 3, 7, 12])  # empty bags first, in the middle
    idx = _indices(num, (15,), [0, 1, num - 1, 5 % num])  # heavy repetition
    return idx, offsets


@pytest.mark.parametrize("reuse", REUSES)
# nn.EmbeddingBag takes per_sample_weights only with mode='sum'
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("padding_idx", [None, 1])
def test_bags_match_nn_embedding_bag(mode, weighted, padding_idx, reuse):
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3, mode=mode, padding_idx=padding_idx, reuse=reuse)
    table, cores, gates = _reference(emb)
    idx, offsets = _bag_cases(23)
    psw = torch.randn(15, dtype=torch.float64, requires_grad=True) if weighted else None
    psw_r = psw.detach().clone().requires_grad_() if weighted else None
    y = emb(idx, offsets, psw)
    yr = F.embedding_bag(idx, table, offsets, mode=mode, per_sample_weights=psw_r,
                         padding_idx=padding_idx)
    assert y.shape == (6, 10)
    assert torch.all(y[[0, 2]] == 0)  # empty bags
    torch.testing.assert_close(y, yr)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (yr * g).sum().backward()
    _check_grads(emb, cores, gates, torch.float64)
    if weighted:
        torch.testing.assert_close(psw.grad, psw_r.grad)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_input_forms(mode):
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3, mode=mode)
    dense = emb.to_dense()
    assert isinstance(dense, nn.EmbeddingBag) and dense.mode == mode
    x2 = torch.randint(0, 23, (4, 5))
    torch.testing.assert_close(emb(x2), dense(x2))
    flat, offsets = x2.reshape(-1), torch.tensor([0, 5, 10, 15])
    torch.testing.assert_close(emb(flat, offsets), dense(flat, offsets))
    torch.testing.assert_close(emb(flat.int(), offsets.int()), dense(flat, offsets))
    last = comera.TTEmbedding.from_dense(dense, rank=3)
    last.include_last_offset = True
    dense_last = nn.EmbeddingBag(23, 10, mode=mode, include_last_offset=True, dtype=torch.float64)
    dense_last.weight.data.copy_(last.weight.detach())
    inc = torch.tensor([0, 5, 5, 20])  # CSR: the last offset is len(input)
    torch.testing.assert_close(last(flat, inc), dense_last(flat, inc))
    with pytest.raises(ValueError, match="last one must equal the number of indices"):
        last(flat, torch.tensor([0, 5, 12]))


def test_empty_inputs():
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3)
    idx = torch.zeros(0, dtype=torch.int64)
    y = emb(idx)
    assert y.shape == (0, 10)
    y.sum().backward()
    assert all(torch.all(p.grad == 0) for p in emb.parameters())
    assert emb(torch.zeros(3, 0, dtype=torch.int64)).shape == (3, 0, 10)
    bag = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3, mode="mean")
    assert bag(idx, torch.zeros(0, dtype=torch.int64)).shape == (0, 10)
    out = bag(idx, torch.zeros(4, dtype=torch.int64))
    assert out.shape == (4, 10) and torch.all(out == 0)
    out.sum().backward()
    assert all(torch.all(p.grad == 0) for p in bag.parameters())
    assert bag(torch.zeros(3, 0, dtype=torch.int64)).shape == (3, 10)


def test_large_batch_many_threads_against_reconstruction():
    """Thousands of Zipf-like indices: thread chunks, long shared prefixes."""
    emb = comera.TTEmbedding(2000, 24, rank=6, dtype=torch.float64)
    with torch.no_grad():
        for g in emb.gates:
            g.uniform_(0.5, 1.5)
    p = torch.arange(1, 2001, dtype=torch.float64) ** -1.1
    idx = torch.multinomial(p, 5000, replacement=True)
    w = emb.weight
    grads = {}
    for reuse in ("none", "prefix"):
        emb.reuse = reuse
        emb.zero_grad()
        y = emb(idx)
        torch.testing.assert_close(y, w[idx])
        g = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
        (y * g).sum().backward()
        grads[reuse] = [q.grad.clone() for q in emb.parameters()]
    emb.zero_grad()
    (ttm_full(list(emb.cores), list(emb.gates))[:2000, :24][idx] * g).sum().backward()
    for a, b, ref in zip(grads["none"], grads["prefix"], (q.grad for q in emb.parameters())):
        torch.testing.assert_close(a, ref)
        torch.testing.assert_close(b, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_output_past_the_cache_copies_repeated_rows_exactly(threads):
    """A float32 output of 8 MB or more: repeated rows reach their further
    positions by streaming stores (csrc/common/gemm.h), in every strategy and
    thread count, equal to the rows computed at their first position."""
    emb = comera.TTEmbedding(1000, 1024, rank=4)
    idx = torch.randint(0, 50, (2100,), generator=torch.Generator().manual_seed(0))
    assert idx.numel() * 1024 * 4 >= 8 << 20 and idx.unique().numel() < 60
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            w = emb.weight
            for reuse in ("none", "dedup", "prefix"):
                emb.reuse = reuse
                y = emb(idx)
                torch.testing.assert_close(y, w[idx])
                first = {}
                for p, i in enumerate(idx.tolist()):
                    first.setdefault(i, p)
                assert torch.equal(y, y[[first[i] for i in idx.tolist()]])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_level_one_backward_matches_the_dense_table(threads):
    """A core 1 of 1 MB or more (float32): the level-1 backward runs grouped
    by core-1 slice (csrc/tt_embedding/cpu_bwd_impl.h), in windows of 2048
    prefixes; no dedup's 5000 rows take three windows.  Every strategy's
    gradients equal those of the dense table's lookup (float64 reference)."""
    torch.manual_seed(0)
    emb = comera.TTEmbedding(5120, 64, rank=32, shape=([8, 80, 8], [4, 4, 4]))
    assert emb.cores[1].numel() * 4 >= 1 << 20 and emb.ranks == [32, 32]
    with torch.no_grad():
        for g in emb.gates:
            g.uniform_(0.5, 1.5)  # gates enter the grouped products: not all ones
    idx = torch.randint(0, 5120, (5000,))
    idx[:1500] = torch.randint(0, 200, (1500,))  # repeated rows and shared prefixes
    gout = torch.randn(5000, 64)
    cores = [c.detach().double().requires_grad_() for c in emb.cores]
    gates = [g.detach().double().requires_grad_() for g in emb.gates]
    table = ttm_table(cores, gates, 5120, 64)
    (table[idx] * gout.double()).sum().backward()
    want = [t.grad for t in cores + gates]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for reuse in ("none", "dedup", "prefix"):
            emb.reuse = reuse
            emb.zero_grad(set_to_none=True)
            emb(idx).backward(gout)
            for p, w in zip(list(emb.cores) + list(emb.gates), want):
                tol = 2e-4 * w.abs().max().item()
                torch.testing.assert_close(p.grad.double(), w, rtol=2e-4, atol=tol)
    finally:
        torch.set_num_threads(old)


def test_gradients_independent_of_index_order_and_thread_count():
    torch.manual_seed(0)
    emb = comera.TTEmbedding(500, 16, rank=5)
    idx = torch.randint(0, 60, (2000,))
    g = torch.randn(2000, 16)
    perm = torch.randperm(2000)

    def grads(i, gg):
        emb.zero_grad()
        (emb(i) * gg).sum().backward()
        return [p.grad.clone() for p in emb.parameters()]

    base = grads(idx, g)
    again = grads(idx, g)
    for a, b in zip(base, again):
        assert torch.equal(a, b)  # deterministic run to run
    # another order sums each row's ~33 float32 terms in another order: equal
    # up to rounding (a missing or doubled term would be off by O(1))
    for a, b in zip(base, grads(idx[perm], g[perm])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = grads(idx, g)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(base, single):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", [None, "sum"])
def test_gradcheck_float64(mode):
    emb = _make(20, 9, ([3, 2, 4], [3, 1, 3]), 3, mode=mode)
    idx = torch.tensor([3, 19, 3, 0, 7, 3])
    params = list(emb.cores) + list(emb.gates)
    d = len(emb.cores)
    offsets = torch.tensor([0, 2, 2, 6]) if mode else None

    def f(*ps):
        cores, gates, rest = ps[:d], ps[d:2 * d - 1], ps[2 * d - 1:]
        psw = rest[0] if rest else None
        return comera.ops.tt_embedding(idx, cores, gates, 20, 9, offsets=offsets,
                                       per_sample_weights=psw, mode=mode, padding_idx=0)

    def raw(*ps):  # the operator itself, through its registered autograd
        cores, gates, rest = ps[:d], ps[d:2 * d - 1], ps[2 * d - 1:]
        offs = torch.cat([offsets, torch.tensor([6])]) if mode else None
        return torch.ops.comera.tt_embedding(idx, offs, rest[0] if rest else None, list(cores),
                                             list(gates), 20, 9, 0, 1 if mode else 0, 0)

    extra = [torch.randn(6, dtype=torch.float64, requires_grad=True)] if mode else []
    assert torch.autograd.gradcheck(f, (*params, *extra))
    assert torch.autograd.gradcheck(raw, (*params, *extra))


def test_opcheck():
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3, dtype=torch.float32)
    cores, gates = list(emb.cores), list(emb.gates)
    idx = torch.tensor([4, 4, 0, 22, 9, 4])
    offsets = torch.tensor([0, 2, 2, 6])
    psw = torch.randn(6, requires_grad=True)
    for args in ((idx, None, None, cores, gates, 23, 10, 4, 0, 0),
                 (idx, offsets, psw, cores, gates, 23, 10, 0, 1, 1)):
        torch.library.opcheck(torch.ops.comera.tt_embedding.default, args)
        out = torch.ops.comera.tt_embedding(*args)
        d_args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        bargs = (torch.randn_like(out), *d_args[:3], [c.detach() for c in cores],
                 [g.detach() for g in gates], *d_args[5:])
        torch.library.opcheck(torch.ops.comera.tt_embedding_backward.default, bargs)


@pytest.mark.parametrize("mode", [None, "sum"])
def test_torch_compile_fullgraph_matches_eager(mode):
    torch._dynamo.reset()
    torch.manual_seed(3)
    emb = comera.TTEmbedding(300, 16, rank=4, mode=mode)
    head = nn.Linear(16, 3)
    idx = torch.randint(0, 300, (8, 5))

    def run(module_call):
        emb.zero_grad()
        head.zero_grad()
        out = head(module_call(idx)).square().sum()
        out.backward()
        return out.detach(), [p.grad.clone() for p in list(emb.parameters()) + list(head.parameters())]

    compiled = torch.compile(emb, fullgraph=True)
    y_c, g_c = run(compiled)
    y_e, g_e = run(emb)
    torch.testing.assert_close(y_c, y_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_out_of_range_and_bad_index_types():
    emb = comera.TTEmbedding(23, 10, rank=3)
    with pytest.raises(IndexError, match="num_embeddings=23"):
        emb(torch.tensor([0, 23]))
    with pytest.raises(IndexError, match="-1"):
        emb(torch.tensor([[1, -1]]))
    with pytest.raises(IndexError, match="0 <= index < 23"):
        emb(torch.tensor([25]))  # 23..24 are padding rows of the 25-row TT shape
    with pytest.raises(TypeError, match="int64 or int32"):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="Tensor"):
        emb([1, 2])
    with pytest.raises(ValueError, match="bag"):
        emb(torch.tensor([1, 2]), torch.tensor([0]))
    bag = comera.TTEmbedding(23, 10, rank=3, mode="sum")
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([1, 2]))  # must start at 0
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))  # decreasing
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(TypeError, match="offsets"):
        bag(torch.tensor([1, 2]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="per_sample_weights"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3))
    with pytest.raises(ValueError, match="per_sample_weights"):
        comera.TTEmbedding(23, 10, rank=3, mode="mean")(torch.tensor([1]), torch.tensor([0]),
                                                        torch.ones(1))
    with pytest.raises(IndexError, match="num_embeddings=23"):
        bag(torch.tensor([1, 99]), torch.tensor([0]))


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(rank=0), ValueError, "rank"),
    (dict(rank=[2]), ValueError, "rank"),
    (dict(rank=2.5), TypeError, "rank"),
    (dict(rank=2, shape=([2, 3], [2, 5])), ValueError, "num_embeddings"),
    (dict(rank=2, shape=([5, 5], [2, 3])), ValueError, "embedding_dim"),
    (dict(rank=2, shape=([25], [10])), ValueError, "2 to 16"),
    (dict(rank=2, shape=([5, 5], [10, 1, 1])), ValueError, "as many"),
    (dict(rank=2, shape=1), ValueError, "core count"),
    (dict(rank=2, shape="big"), ValueError, "shape"),
    (dict(rank=2, padding_idx=23), ValueError, "padding_idx"),
    (dict(rank=2, mode="max"), ValueError, "mode"),
    (dict(rank=2, reuse="fast"), ValueError, "reuse"),
    (dict(rank=2, dtype=torch.int64), TypeError, "dtype"),
])
def test_bad_constructor_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        comera.TTEmbedding(23, 10, **kwargs)
    with pytest.raises(ValueError, match="num_embeddings"):
        comera.TTEmbedding(0, 10, rank=2)


def test_op_level_bad_arguments_raise_not_crash():
    emb = comera.TTEmbedding(23, 10, rank=3)
    cores, gates = list(emb.cores), list(emb.gates)
    idx = torch.tensor([1, 2])
    op = torch.ops.comera.tt_embedding
    with pytest.raises(ValueError, match="gates"):
        op(idx, None, None, cores, gates[:1], 23, 10, -1, 0, 0)
    with pytest.raises(ValueError, match="core 1"):
        op(idx, None, None, [cores[0], cores[1][:1]] + cores[2:], gates, 23, 10, -1, 0, 0)
    with pytest.raises(ValueError, match="num_embeddings"):
        op(idx, None, None, cores, gates, 10 ** 6, 10, -1, 0, 0)
    with pytest.raises(ValueError, match="padding_idx"):
        op(idx, None, None, cores, gates, 23, 10, 23, 0, 0)
    with pytest.raises(ValueError, match="reuse"):
        op(idx, None, None, cores, gates, 23, 10, -1, 0, 9)
    with pytest.raises(ValueError, match="mode"):
        op(idx, None, None, cores, gates, 23, 10, -1, 5, 0)
    with pytest.raises(ValueError, match="offsets"):
        op(idx, None, None, cores, gates, 23, 10, -1, 1, 0)
    with pytest.raises(ValueError, match="offsets"):
        op(idx, torch.tensor([0, 3]), None, cores, gates, 23, 10, -1, 1, 0)
    with pytest.raises(TypeError, match="indices"):
        op(idx.float(), None, None, cores, gates, 23, 10, -1, 0, 0)
    with pytest.raises(ValueError, match="overflow"):
        torch.ops.comera.tt_embedding_plan(idx, None, [1 << 40, 1 << 40], [2, 2], [1, 1, 1],
                                           23, 4, -1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,dims,rank", [(12, [4, 3], 3), (25, [5, 5, 8], 8)])
def test_table_rows_do_not_depend_on_the_first_cores_slice_count(dtype, rows, dims, rank):
    # rows come and go by slices of the first core (a resized vocabulary): the
    # kept rows of ttm_full must stay bit-exact, whatever a BLAS does at
    # another row count
    torch.manual_seed(0)
    cores = [torch.randn(1, rows, dims[0], rank, dtype=dtype)]
    cores += [torch.randn(rank, 3, d, rank if k < len(dims) - 2 else 1, dtype=dtype)
              for k, d in enumerate(dims[1:])]
    gates = [torch.rand(c.shape[-1], dtype=dtype) for c in cores[:-1]]
    table = ttm_full(cores, gates)
    grown = [torch.cat([cores[0], torch.randn(1, 7, dims[0], rank, dtype=dtype)], 1)] + cores[1:]
    kept = ttm_full(grown, gates)[: table.shape[0]]
    assert torch.equal(kept, table)
    if len(cores) == 2:  # row (i, j), column (p, q)
        reference = torch.einsum("aipb,bjqc->ijpq", cores[0] * gates[0], cores[1])
        torch.testing.assert_close(table, reference.reshape(table.shape))


def test_from_dense_cores_are_contiguous():
    # LAPACK's factors are column-major: cores keeping those strides were copied
    # by every kernel call and rounded differently from a reloaded copy
    emb = comera.TTEmbedding.from_dense(torch.randn(23, 10), rank=3)
    lin = comera.TTLinear.from_dense(nn.Linear(24, 12), rank=3)
    assert all(c.is_contiguous() for c in list(emb.cores) + list(lin.cores))


def test_weight_to_dense_and_from_dense_round_trip():
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 3)
    table, _, _ = _reference(emb)
    torch.testing.assert_close(emb.weight, table)
    dense = emb.to_dense()
    assert isinstance(dense, nn.Embedding) and dense.weight.shape == (23, 10)
    idx = torch.randint(0, 23, (4, 6))
    torch.testing.assert_close(dense(idx), emb(idx))
    # TT-SVD at full rank reproduces any table; truncation is exact on a TT-rank-3 table
    base = nn.Embedding(23, 10, padding_idx=2, dtype=torch.float64)
    full = comera.TTEmbedding.from_dense(base, rank=1000, shape=([2, 3, 4], [2, 3, 2]))
    assert full.padding_idx == 2
    torch.testing.assert_close(full.weight, base.weight)
    teacher = _make(24, 12, ([2, 3, 4], [2, 3, 2]), 3)  # no padding rows: exactly TT rank 3
    again = comera.TTEmbedding.from_dense(teacher.weight.detach(), rank=3,
                                          shape=([2, 3, 4], [2, 3, 2]))
    assert again.ranks == [3, 3]
    torch.testing.assert_close(again.weight, teacher.weight.detach())
    torch.testing.assert_close(again(idx), teacher(idx))
    small = comera.TTEmbedding.from_dense(base.weight, rank=1)
    assert small.ranks == [1, 1] and small.padding_idx is None
    bag = comera.TTEmbedding.from_dense(nn.EmbeddingBag(23, 10, mode="sum"), rank=2)
    assert bag.mode == "sum"
    with pytest.raises(TypeError, match="from_dense"):
        comera.TTEmbedding.from_dense([[1.0]])
    with pytest.raises(ValueError, match="2-D"):
        comera.TTEmbedding.from_dense(torch.zeros(3))


def test_default_shape_init_variance_and_compression():
    emb = comera.TTEmbedding(30522, 768, rank=32)
    assert emb.row_shape == [37, 25, 33] and emb.dim_shape == [8, 8, 12]
    assert math.prod(emb.row_shape) >= 30522
    assert emb.tt_params() == 37 * 8 * 32 + 32 * 25 * 8 * 32 + 32 * 33 * 12
    assert emb.compression() > 100
    w = emb.weight.detach()
    assert w.shape == (30522, 768)
    assert 0.8 < w.var().item() < 1.25  # nn.Embedding's N(0, 1)
    four = comera.TTEmbedding(30522, 768, rank=32, shape=4)
    assert len(four.cores) == 4 and four.compression() > emb.compression()
    r = repr(emb)
    assert "ranks=[32, 32]" in r and "compression=" in r


def test_rank_shrink_in_place_keeps_working():
    emb = _make(23, 10, ([2, 3, 4], [2, 3, 2]), 4)
    with torch.no_grad():  # cut bond 0 to rank 2 and bond 1 to rank 3, as a pruner would
        c0, c1, c2 = emb.cores
        c0.data = c0.data[..., :2].clone()
        c1.data = c1.data[:2, :, :, :3].clone()
        c2.data = c2.data[:3].clone()
        emb.gates[0].data = emb.gates[0].data[:2].clone()
        emb.gates[1].data = emb.gates[1].data[:3].clone()
    assert emb.ranks == [2, 3]
    assert emb.tt_params() == 2 * 2 * 2 + 2 * 3 * 3 * 3 + 3 * 4 * 2
    table, cores, gates = _reference(emb)
    idx = torch.randint(0, 23, (40,))
    y = emb(idx)
    torch.testing.assert_close(y, table[idx])
    y.square().sum().backward()
    table[idx].square().sum().backward()
    _check_grads(emb, cores, gates, torch.float64)


def test_plan_counts_rows_and_prefixes():
    emb = comera.TTEmbedding(1000, 64, rank=8, shape=([10, 10, 10], [4, 4, 4]), padding_idx=999)
    idx = torch.tensor([5, 5, 7, 123, 129, 999, 5, 998])
    p = emb.plan(idx)
    assert p["rows"] == 7 and p["unique"] == 5  # 999 is padding
    # prefixes: i_1 in {0, 1, 9}; (i_1, i_2) in {00, 12, 99}; rows {5, 7, 123, 129, 998}
    assert p["prefixes"] == [3, 3, 5]
    assert p["flops"]["prefix"] < p["flops"]["dedup"] < p["flops"]["none"]
    assert p["reuse"] == "prefix"
    tiny = comera.TTEmbedding(10, 2, rank=1, shape=([5, 2], [2, 1]))
    assert tiny.plan(idx[:2])["reuse"] == "none"  # rows too cheap to be worth a sort


def test_optimizer_fits_a_small_table():
    torch.manual_seed(1)
    target = comera.TTEmbedding(64, 8, rank=2, dtype=torch.float64).weight.detach()
    emb = comera.TTEmbedding(64, 8, rank=4, dtype=torch.float64)
    opt = torch.optim.Adam(emb.parameters(), lr=2e-2)
    first = None
    for _ in range(300):
        idx = torch.randint(0, 64, (128,))
        loss = (emb(idx) - target[idx]).square().mean()
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02 * first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", [None, "sum"])
def test_eager_path_equals_the_registered_autograd(dtype, mode):
    """Eager training goes through ops.embedding.TTEmbeddingFunction; its values
    and gradients are the registered autograd's, bit for bit."""
    from comera.ops import embedding as E
    emb = comera.TTEmbedding(50, 12, rank=3).to(dtype)
    idx = torch.randint(0, 50, (6, 4))
    if mode is None:
        out = emb(idx)
        args = (idx.reshape(-1), None, None)
    else:
        out = comera.ops.tt_embedding(idx, list(emb.cores), list(emb.gates), 50, 12, mode="sum")
        args = (idx.reshape(-1), torch.arange(0, 25, 4), None)  # 6 bags, offsets end at 24
    fn = out.grad_fn
    names = [type(fn).__name__, type(fn.next_functions[0][0]).__name__] if fn.next_functions \
        else [type(fn).__name__]
    assert "TTEmbeddingFunctionBackward" in names
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(emb.parameters()), g)
    ref = torch.ops.comera.tt_embedding(*args, list(emb.cores), list(emb.gates), 50, 12, -1,
                                        0 if mode is None else E.MODES["sum"], 0)
    grads_ref = torch.autograd.grad(ref, list(emb.parameters()), g.reshape(ref.shape))
    assert torch.equal(out.reshape(ref.shape), ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)
    if mode is None:
        with torch.no_grad():  # the no-grad path calls the operator below autograd
            assert torch.equal(emb(idx), out)
