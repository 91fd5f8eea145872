"""torch.compile and AMP (autocast) on converted models."""
import copy

import pytest
import torch
from torch import nn

import comera
from comera.layers.tied import TiedTTLinear
from ttm_standin import StandInTTM


def _tiny_bert(layers=1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=layers,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _loss_and_grads(model, fn, ids):
    model.zero_grad(set_to_none=True)
    out = fn(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


# --------------------------------------------------------------- torch.compile
def test_compile_fullgraph_converted_bert_matches_eager():
    torch.manual_seed(0)
    model = _tiny_bert()
    comera.convert(model, rank=8)
    model.train()
    ids = torch.randint(0, 200, (2, 16))
    logits_e, loss_e, grads_e = _loss_and_grads(model, model, ids)
    compiled = torch.compile(model, fullgraph=True)
    logits_c, loss_c, grads_c = _loss_and_grads(model, compiled, ids)
    torch.testing.assert_close(logits_c, logits_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    tt_grads = [n for n in grads_e if ".cores." in n or ".gates." in n]
    assert len(tt_grads) > 20                     # the TT layers are really in the graph
    for n in grads_e:
        torch.testing.assert_close(grads_c[n], grads_e[n], atol=1e-5, rtol=1e-5, msg=n)


def test_compile_fullgraph_tied_tt_head():
    emb = StandInTTM(30, 8, [2, 4, 4], [2, 2, 2], [3, 3])
    head = TiedTTLinear(emb, bias=nn.Parameter(torch.zeros(30, dtype=torch.float64)))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    y_e = head(x)
    y_c = torch.compile(head, fullgraph=True)(x)
    torch.testing.assert_close(y_c, y_e)
    g_e = torch.autograd.grad(y_e.sum(), list(emb.cores))
    g_c = torch.autograd.grad(y_c.sum(), list(emb.cores))
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------ AMP
def test_autocast_tt_linear_computes_in_fp32_and_returns_bf16():
    layer = comera.TTLinear(96, 64, rank=6)
    x = torch.randn(17, 96, requires_grad=True)
    ref_layer = copy.deepcopy(layer)
    xr = x.detach().clone().requires_grad_()
    ref = ref_layer(xr)                                            # float32 everywhere
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        lin_y = nn.Linear(96, 64)(x)
    assert y.dtype == lin_y.dtype == torch.bfloat16                 # the same convention as nn.Linear
    # bf16 products with fp32 accumulation: within bf16 rounding of the fp32 result
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    ref.sum().backward()
    assert all(c.grad.dtype == torch.float32 for c in layer.cores)
    torch.testing.assert_close(x.grad, xr.grad, atol=2e-2, rtol=2e-2)
    for c, cr in zip(layer.cores, ref_layer.cores):
        torch.testing.assert_close(c.grad, cr.grad, atol=1e-1, rtol=1e-1)
    torch.testing.assert_close(layer.bias.grad, ref_layer.bias.grad)


def test_autocast_bf16_input_is_accumulated_in_fp32():
    layer = comera.TTLinear(64, 48, rank=4)
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ layer.weight.detach().t() + layer.bias.detach()
    torch.testing.assert_close(y, ref.to(torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_autocast_direct_op_call_runs_the_16_bit_kernels():
    layer = comera.TTLinear(32, 16, rank=3)
    x = torch.randn(4, 32).to(torch.bfloat16)
    cores = [c.detach() for c in layer.cores]
    gates = [g.detach() for g in layer.gates]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = torch.ops.comera.tt_linear(x, cores, gates, layer.bias.detach(), layer.num_in_cores, 16, 0)
    assert y.dtype == torch.bfloat16                     # computed by the 16-bit kernels, as F.linear
    ref = x.float() @ layer.weight.detach().t() + layer.bias.detach()
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)


def test_autocast_leaves_float64_layers_alone():
    layer = comera.TTLinear(32, 16, rank=3, dtype=torch.float64)
    x = torch.randn(4, 32, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ layer.weight.t() + layer.bias)


def test_autocast_training_of_a_converted_bert_runs_and_learns():
    torch.manual_seed(0)
    model = _tiny_bert(layers=2)
    comera.convert(model, rank=8)
    model.train()
    ids = torch.randint(0, 200, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        assert out.logits.dtype == torch.bfloat16
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    q = model.bert.encoder.layer[0].attention.self.query
    assert isinstance(q, comera.TTLinear)
    assert all(c.dtype == torch.float32 and c.grad.dtype == torch.float32 for c in q.cores)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5


def test_autocast_under_compile_matches_eager():
    torch.manual_seed(0)
    net = comera.convert(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)), rank=6)
    x = torch.randn(8, 64)

    def run(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(x)

    y_e = run(net)
    y_c = run(torch.compile(net, fullgraph=True))
    assert y_c.dtype == y_e.dtype == torch.bfloat16
    torch.testing.assert_close(y_c.float(), y_e.float(), atol=2e-2, rtol=2e-2)
