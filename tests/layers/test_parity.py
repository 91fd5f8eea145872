"""Drop-in parity with nn.Linear / nn.Embedding, in the style of PyTorch's
ModuleInfo tests: one table of module cases, each run through the same
checks (values and gradients against the dense equivalent for inputs of
rank 0/1 to 4, zero-size, non-contiguous and channels-last; dtypes;
deepcopy; whole-module pickle; state_dict round trip; torch.export;
torch.compile; activation checkpointing; functional_call; clip_grad_norm_;
train/eval).  The dense equivalent is the TT layer's own reconstruction
(``.weight`` with F.linear / F.embedding, or ``comera.to_dense`` of a copy
for a converted model).  bfloat16/float16 modules are compared with the
float32 result of the same module cast to float32 (their math runs in
float32 on the CPU).  Differences by design are asserted in
``test_difference_*`` tests, each naming the difference.
"""
import copy
import inspect
import io
from dataclasses import dataclass, field
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera
from comera.layers.tied import TiedTTLinear

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF = (torch.bfloat16, torch.float16)
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5),
       torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


# ------------------------------------------------------------------ the table
@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]                 # float32, CPU
    inputs: Callable[[torch.dtype, str], List[Tuple[str, tuple]]]
    reference: Callable[[nn.Module, tuple], torch.Tensor]   # the dense equivalent
    floating_input: bool = True
    export: bool = True
    compile: bool = False
    marks: list = field(default_factory=list)


def _linear_inputs(in_f):
    def inputs(dtype, device):
        r = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
        return [
            ("1d", (r(in_f),)),
            ("2d", (r(5, in_f),)),
            ("3d", (r(2, 3, in_f),)),
            ("4d", (r(2, 3, 2, in_f),)),
            ("zero_rows", (r(0, in_f),)),
            ("zero_middle", (r(2, 0, in_f),)),
            ("non_contiguous", (r(in_f, 5).t(),)),
            ("strided", (r(4, 2 * in_f)[:, ::2],)),
            ("channels_last", (r(2, 3, 4, in_f).contiguous(memory_format=torch.channels_last),)),
        ]
    return inputs


def _embedding_inputs(num):
    def inputs(dtype, device):
        i = lambda *s: torch.randint(0, num, s, device=device)  # noqa: E731
        return [
            ("0d", (torch.tensor(3, device=device),)),
            ("1d", (i(7),)),
            ("2d", (i(3, 4),)),
            ("3d", (i(2, 3, 2),)),
            ("4d", (i(2, 2, 2, 3),)),
            ("zero_size", (i(0, 4),)),
            ("padding_rows", (torch.tensor([[1, 0, 1], [5, 1, 7]], device=device),)),
            ("int32", (i(3, 4).int(),)),
            ("non_contiguous", (i(4, 3).t(),)),
            ("channels_last", (i(2, 3, 2, 2).contiguous(memory_format=torch.channels_last),)),
        ]
    return inputs


def _bag_inputs(num):
    def inputs(dtype, device):
        i = lambda *s: torch.randint(0, num, s, device=device)  # noqa: E731
        return [
            ("2d_bags", (i(3, 4),)),
            ("offsets", (i(7), torch.tensor([0, 2, 2, 5], device=device))),
            ("zero_bags", (i(0, 4),)),
        ]
    return inputs


def _ref_linear(m, args):
    (x,) = args
    return F.linear(x, m.weight, m.bias)


def _ref_embedding(m, args):
    return F.embedding(args[0], m.weight, padding_idx=m.padding_idx)


def _ref_bag(m, args):
    x, offsets = (args + (None,))[:2]
    return F.embedding_bag(x, m.weight, offsets, mode=m.mode, padding_idx=m.padding_idx)


def _mlp():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 10))
    return comera.convert(net, rank=4, min_compression=0.1)


def _ref_model(m, args):
    return comera.to_dense(copy.deepcopy(m))(*args)


class _TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 12, padding_idx=0)
        self.proj = nn.Linear(12, 16)
        self.head = nn.Linear(16, 40)

    def forward(self, idx):
        return self.head(torch.tanh(self.proj(self.emb(idx))))


def _token_model():
    torch.manual_seed(2)
    return comera.convert(_TokenModel(), rank=4, min_compression=0.1)


def _token_inputs(dtype, device):
    return [("2d", (torch.randint(0, 40, (3, 5), device=device),)),
            ("zero_size", (torch.randint(0, 40, (0, 5), device=device),))]


CASES = [
    Case("TTLinear", lambda: comera.TTLinear(24, 10, rank=3), _linear_inputs(24), _ref_linear,
         compile=True),
    Case("TTLinear_nobias", lambda: comera.TTLinear(24, 10, bias=False, rank=3),
         _linear_inputs(24), _ref_linear),
    Case("TTLinear_padded", lambda: comera.TTLinear(23, 11, rank=3), _linear_inputs(23),
         _ref_linear),
    Case("TTEmbedding", lambda: comera.TTEmbedding(60, 12, rank=3, padding_idx=1),
         _embedding_inputs(60), _ref_embedding, floating_input=False, compile=True),
    Case("TTEmbedding_sum", lambda: comera.TTEmbedding(60, 12, rank=3, mode="sum"),
         _bag_inputs(60), _ref_bag, floating_input=False, export=False),
    Case("TTEmbedding_mean", lambda: comera.TTEmbedding(60, 12, rank=3, mode="mean", padding_idx=2),
         _bag_inputs(60), _ref_bag, floating_input=False, export=False),
    Case("converted_mlp", _mlp, _linear_inputs(24), _ref_model),
    Case("converted_token_model", _token_model, _token_inputs, _ref_model, floating_input=False),
]
IDS = [c.name for c in CASES]


def _build(case, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return case.make().to(device=device, dtype=dtype)


def _cast_inputs(args, dtype):
    return tuple(a.to(dtype) if a.is_floating_point() else a for a in args)


def _assert_close(got, want, dtype, scale=1.0):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want.to(got.dtype), rtol=rtol, atol=atol * scale)


def _grads(module, args, seed=3):
    """Loss = <out, fixed random>, backward; the parameter and input grads."""
    args = tuple(a.detach().requires_grad_() if a.is_floating_point() else a for a in args)
    out = module(*args)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    (out * w).sum().backward()
    params = {k: p.grad for k, p in module.named_parameters()}
    return out, params, [a.grad for a in args if a.is_floating_point()]


# ----------------------------------------------------------- values and grads
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_backward_match_dense(case, dtype, device):
    module = _build(case, dtype, device)
    for desc, args in case.inputs(dtype, device):
        out, grads, in_grads = _grads(module, args)
        module.zero_grad(set_to_none=True)
        assert out.dtype == dtype, desc
        if dtype in HALF:
            # the float32 result of the same module (bf16/fp16 cast up exactly)
            ref_mod = copy.deepcopy(module).float()
            ref_args = _cast_inputs(args, torch.float32)
            ref_out, ref_grads, ref_in = _grads(ref_mod, ref_args)
            _assert_close(out, ref_out, dtype)
            for k, g in grads.items():
                assert g is None or g.dtype == dtype, (desc, k)
            # parameter grads: relative to their own scale
            for k, g in grads.items():
                if g is not None and ref_grads[k] is not None:
                    _assert_close(g, ref_grads[k], dtype, scale=float(ref_grads[k].abs().max()) + 1)
            continue
        # the TT kernels against the dense equivalent, computed by autograd
        # through the reconstruction (so core/gate grads are compared too)
        ref_args = tuple(a.detach().requires_grad_() if a.is_floating_point() else a for a in args)
        dense_mod = copy.deepcopy(module)
        ref_out = case.reference(dense_mod, ref_args)
        assert ref_out.shape == out.shape, desc
        _assert_close(out, ref_out, dtype)
        if case.reference is _ref_model:
            continue  # the densified copy has other parameters; values suffice
        g = torch.Generator().manual_seed(3)
        w = torch.randn(ref_out.shape, generator=g).to(device=ref_out.device, dtype=ref_out.dtype)
        (ref_out * w).sum().backward()
        for k, p in dense_mod.named_parameters():
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            _assert_close(grads[k] if grads[k] is not None else torch.zeros_like(p), want, dtype)
        for a, b in zip(in_grads, [a.grad for a in ref_args if a.is_floating_point()]):
            _assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("TTLinear", "TTEmbedding")],
                         ids=lambda c: c.name)
def test_half_built_directly_and_to_dense(case, dtype):
    kwargs = dict(dtype=dtype)
    torch.manual_seed(0)
    if case.name == "TTLinear":
        m = comera.TTLinear(24, 10, rank=3, **kwargs)
    else:
        m = comera.TTEmbedding(60, 12, rank=3, padding_idx=1, **kwargs)
    assert all(p.dtype == dtype for p in m.parameters())
    dense = m.to_dense()
    assert dense.weight.dtype == dtype
    # the reconstruction runs in float32 and is rounded once
    _assert_close(dense.weight, copy.deepcopy(m).float().weight, dtype)


# ------------------------------------------------------------- serialisation
def _example(case, dtype=torch.float32, device="cpu"):
    return case.inputs(dtype, device)[1][1]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deepcopy(case):
    m = _build(case)
    args = _example(case)
    c = copy.deepcopy(m)
    torch.testing.assert_close(c(*args), m(*args), rtol=0, atol=0)
    assert all(p is not q for p, q in zip(c.parameters(), m.parameters()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_module_pickle(case):
    m = _build(case)
    args = _example(case)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(m)
    torch.testing.assert_close(loaded(*args), m(*args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_dict_round_trip(case, dtype):
    m = _build(case, dtype)
    args = _cast_inputs(_example(case), dtype)
    torch.manual_seed(123)
    fresh = case.make().to(dtype)
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(fresh(*args), m(*args), rtol=0, atol=0)
    assert m.state_dict().keys() == fresh.state_dict().keys()


@pytest.mark.parametrize("case", [c for c in CASES if c.export], ids=lambda c: c.name)
def test_torch_export(case):
    m = _build(case).eval()
    args = _example(case)
    ep = torch.export.export(m, args)
    torch.testing.assert_close(ep.module()(*args), m(*args))


@pytest.mark.parametrize("case", [c for c in CASES if c.compile], ids=lambda c: c.name)
def test_torch_compile(case):
    torch._dynamo.reset()
    m = _build(case)
    args = _example(case)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out, grads, _ = _grads(compiled, args)
    m.zero_grad(set_to_none=True)
    ref, ref_grads, _ = _grads(m, args)
    torch.testing.assert_close(out, ref)
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k.removeprefix("_orig_mod.")])


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_activation_checkpointing(case):
    from torch.utils.checkpoint import checkpoint
    m = _build(case)
    args = _example(case)
    ref, ref_grads, _ = _grads(m, args)
    m.zero_grad(set_to_none=True)

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *a):
            return checkpoint(self.inner, *a, use_reentrant=False)

    out, grads, _ = _grads(Wrapped(m), args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k.removeprefix("inner.")], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_functional_call(case):
    from torch.func import functional_call
    m = _build(case)
    args = _example(case)
    params = {k: p.detach() * 1.5 for k, p in m.named_parameters()}
    out = functional_call(m, params, args)
    other = copy.deepcopy(m)
    with torch.no_grad():
        for k, p in other.named_parameters():
            p.copy_(params[k])
    torch.testing.assert_close(out, other(*args))
    torch.testing.assert_close(m(*args), _build(case)(*args))  # the module is untouched


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_clip_grad_norm(case):
    m = _build(case)
    _grads(m, _example(case))
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    total = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e-3)
    torch.testing.assert_close(total, want)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                  for p in m.parameters() if p.grad is not None]))
    assert after <= 1e-3 * 1.01


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_train_eval(case):
    m = _build(case)
    args = _example(case)
    y_train = m(*args)
    m.eval()
    assert not any(sub.training for sub in m.modules())
    torch.testing.assert_close(m(*args), y_train, rtol=0, atol=0)
    m.train()
    assert all(sub.training for sub in m.modules())


# ------------------------------------------------------------ meta device
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_meta_device_then_to_empty_and_reset(case):
    with torch.device("meta"):
        m = case.make()
    assert all(p.is_meta for p in m.parameters())
    m = m.to_empty(device="cpu")
    for sub in m.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    args = _example(case)
    out = m(*args)
    assert torch.isfinite(out).all()
    ref = case.reference(copy.deepcopy(m), args)
    _assert_close(out, ref, torch.float32)


def test_constructor_and_forward_signatures_follow_torch():
    """The layers are built and called as the modules they replace: the
    forward argument is ``input`` (``m(input=x)``), and ``TTEmbedding(n, d)``
    / ``TTLinear(i, o)`` need no rank (default 8, capped by the TT bound)."""
    for cls, dense in ((comera.TTLinear, nn.Linear), (TiedTTLinear, nn.Linear),
                       (comera.TTEmbedding, nn.Embedding)):
        assert list(inspect.signature(cls.forward).parameters)[1] == \
            list(inspect.signature(dense.forward).parameters)[1] == "input"
    lin = comera.TTLinear(10, 3)
    x = torch.randn(2, 10)
    torch.testing.assert_close(lin(input=x), lin(x))
    emb = comera.TTEmbedding(10, 3)
    assert emb.ranks == [3, 6] and comera.TTEmbedding(1000, 64).ranks == [8, 8]
    idx = torch.tensor([[1, 9]])
    torch.testing.assert_close(emb(input=idx), emb(idx))
    head = TiedTTLinear(emb)
    torch.testing.assert_close(head(input=torch.ones(2, 3)), head(torch.ones(2, 3)))
    bag = comera.TTEmbedding(10, 3, mode="sum")
    torch.testing.assert_close(bag(input=torch.tensor([1, 2]), offsets=torch.tensor([0, 1])),
                               bag(torch.tensor([1, 2]), torch.tensor([0, 1])))


# ------------------------------------------------------- differences by design
def test_difference_weight_is_a_computed_property():
    """DIFFERENCE: ``.weight`` is reconstructed from the cores on each access
    (differentiable, not a Parameter); it is not in parameters() or the
    state_dict, and assigning to it fails."""
    m = comera.TTLinear(24, 10, rank=3)
    assert not isinstance(m.weight, nn.Parameter)
    assert all(p is not m.weight for p in m.parameters())
    assert "weight" not in m.state_dict()
    with pytest.raises((AttributeError, KeyError)):
        m.weight = nn.Parameter(torch.zeros(10, 24))


def test_difference_state_dict_keys():
    """DIFFERENCE: the state_dict holds cores.k / gates.k (and bias), so a
    dense nn.Linear state_dict does not load into a TTLinear: use
    TTLinear.from_dense / load_dense_ or comera.convert(init='svd')."""
    m = comera.TTLinear(24, 10, rank=3)
    with pytest.raises(RuntimeError, match="weight"):
        m.load_state_dict(nn.Linear(24, 10).state_dict())
    assert set(m.state_dict()) == {"bias"} | {f"cores.{k}" for k in range(len(m.cores))} \
        | {f"gates.{k}" for k in range(len(m.gates))}


def test_difference_float32_layer_accepts_half_input():
    """DIFFERENCE: a float32 TTLinear takes a bfloat16/float16 input (float32
    math, output in the input's dtype) where nn.Linear raises a dtype error."""
    m = comera.TTLinear(24, 10, rank=3)
    x = torch.randn(3, 24)
    with pytest.raises(RuntimeError):
        nn.Linear(24, 10)(x.bfloat16())
    y = m(x.bfloat16())
    assert y.dtype == torch.bfloat16
    _assert_close(y, m(x.bfloat16().float()), torch.bfloat16)


def test_difference_embedding_options_not_supported():
    """DIFFERENCE: TTEmbedding has no max_norm, norm_type, scale_grad_by_freq,
    sparse or _weight arguments, no nn.Embedding.from_pretrained (use
    TTEmbedding.from_dense), and bags have no mode='max'; comera.convert
    leaves such layers dense."""
    for kw in ("max_norm", "scale_grad_by_freq", "sparse", "_weight"):
        with pytest.raises(TypeError):
            comera.TTEmbedding(60, 12, rank=3, **{kw: 1.0 if kw == "max_norm" else True})
    with pytest.raises(ValueError, match="mode"):
        comera.TTEmbedding(60, 12, rank=3, mode="max")
    net = nn.Sequential(nn.Embedding(60, 12, max_norm=1.0))
    comera.convert(net, rank=3)
    assert isinstance(net[0], nn.Embedding)


def test_difference_raw_op_under_torch_func():
    """DIFFERENCE (torch limitation): torch.func transforms work through the
    modules and comera.ops.tt_linear / tt_embedding; calling the raw
    torch.ops.comera.tt_linear under torch.func.grad fails, because the
    autograd.Function torch generates for register_autograd has no
    setup_context."""
    m = comera.TTLinear(24, 10, rank=3)
    x = torch.randn(2, 24)

    def raw(x):
        return torch.ops.comera.tt_linear(x, list(m.cores), list(m.gates), None,
                                          m.num_in_cores, 10, 0)[0].sum()

    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(raw)(x)
    torch.func.grad(lambda x: m(x).sum())(x)  # the module is fine
