"""comera.convert / comera.to_dense on plain modules, nn.TransformerEncoder and
HF transformers models built from a config (no download)."""
import copy
import logging

import pytest
import torch
from torch import nn

import comera
from comera.layers.tied import TiedTTLinear
from ttm_standin import StandInTTM, table_by_entries

def mlp(dtype=torch.float32):
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(),
                         nn.Linear(96, 10)).to(dtype)


def low_tt_rank_weight(in_f, out_f, rank, dtype=torch.float64):
    """A dense weight that is exactly a rank-``rank`` TT (the reference for init='svd')."""
    src = comera.TTLinear(in_f, out_f, rank=rank, dtype=dtype)
    with torch.no_grad():
        for g in src.gates:
            g.uniform_(0.5, 1.5)
    return src.weight.detach().clone()


# ---------------------------------------------------------------- plain models
def test_mlp_converts_every_linear_and_trains():
    net = comera.convert(mlp(), rank=4, min_compression=0.1)
    assert [type(m).__name__ for m in net] == ["TTLinear", "ReLU", "TTLinear", "ReLU", "TTLinear"]
    x, target = torch.randn(32, 64), torch.randint(0, 10, (32,))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_svd_init_is_exact_for_a_weight_of_that_tt_rank():
    w = low_tt_rank_weight(64, 96, rank=3)
    lin = nn.Linear(64, 96, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(w)
    net = comera.convert(nn.Sequential(lin), rank=3, init="svd")
    assert isinstance(net[0], comera.TTLinear)
    torch.testing.assert_close(net[0].weight, w, atol=1e-10, rtol=1e-10)
    assert net[0].bias is lin.bias                       # the bias Parameter itself is kept
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(net(x), x @ w.t() + lin.bias, atol=1e-10, rtol=1e-10)


def test_svd_init_at_full_rank_reproduces_the_model():
    dense = mlp(torch.float64)
    net = comera.convert(copy.deepcopy(dense), rank=10_000, init="svd", min_compression=0.01)
    assert all(isinstance(net[i], comera.TTLinear) for i in (0, 2, 4))
    x = torch.randn(7, 64, dtype=torch.float64)
    torch.testing.assert_close(net(x), dense(x), atol=1e-10, rtol=1e-10)


def test_svd_truncation_error_is_that_of_the_tt_svd_bound():
    # TT-SVD error is at most sqrt(sum over bonds of the discarded squared singular values)
    torch.manual_seed(1)
    lin = nn.Linear(64, 64, dtype=torch.float64)
    net = comera.convert(nn.Sequential(copy.deepcopy(lin)), rank=4, init="svd", min_compression=0.1)
    tt = net[0]
    dims = tt.in_shape + tt.out_shape
    full = lin.weight.detach().t().reshape(-1)
    bound2 = 0.0
    for k in range(1, len(dims)):
        import math
        s = torch.linalg.svdvals(full.reshape(math.prod(dims[:k]), -1))
        bound2 += (s[tt.ranks[k - 1]:] ** 2).sum().item()
    err = (tt.weight - lin.weight).norm().item()
    assert 0 < err <= bound2 ** 0.5 * (1 + 1e-9)


def test_random_init_matches_the_dense_default_variance():
    torch.manual_seed(0)
    vs = []
    for _ in range(4):
        net = comera.convert(nn.Sequential(nn.Linear(768, 3072)), rank=16, init="random")
        vs.append(net[0].weight.detach().var().item())
    target = 1.0 / (3 * 768)                  # Var of uniform(-1/sqrt(in), 1/sqrt(in))
    ratio = sum(vs) / len(vs) / target
    assert 0.6 < ratio < 1.6, ratio


def test_random_init_follows_the_models_own_init_scale():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(768, 768), nn.Embedding(3000, 64))
    with torch.no_grad():                        # an HF-style init: N(0, 0.02^2)
        net[0].weight.normal_(0, 0.02)
        net[1].weight.normal_(0, 0.02)
    dense_ms = [layer.weight.detach().pow(2).mean().item() for layer in net]
    comera.convert(net, rank=16, init="random")
    assert isinstance(net[0], comera.TTLinear) and isinstance(net[1], comera.TTEmbedding)
    for layer, ms in zip(net, dense_ms):
        assert ms == pytest.approx(0.02 ** 2, rel=0.05)
        assert layer.weight.detach().pow(2).mean().item() == pytest.approx(ms, rel=1e-4)


def test_include_exclude_globs_and_rank_mapping():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.ModuleDict({"q": nn.Linear(64, 64), "k": nn.Linear(64, 64)})
            self.ffn = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))

    net = nn.ModuleDict({"enc": nn.ModuleList([Block(), Block()]), "head": nn.Linear(64, 8)})
    comera.convert(net, rank={"*.ffn.*": 8, "*.attn.*": 2}, include=["enc.*"], exclude="enc.1.attn.k")
    kinds = {n: type(m).__name__ for n, m in net.named_modules() if isinstance(m, (nn.Linear, comera.TTLinear))}
    assert kinds == {
        "enc.0.attn.q": "TTLinear", "enc.0.attn.k": "TTLinear", "enc.0.ffn.0": "TTLinear",
        "enc.0.ffn.1": "TTLinear", "enc.1.attn.q": "TTLinear", "enc.1.attn.k": "Linear",
        "enc.1.ffn.0": "TTLinear", "enc.1.ffn.1": "TTLinear", "head": "Linear"}
    assert max(net["enc"][0].attn["q"].ranks) == 2
    assert max(net["enc"][0].ffn[0].ranks) == 8


def test_rank_mapping_without_a_match_leaves_the_layer_dense():
    net = comera.convert(mlp(), rank={"0": 4}, min_compression=0.1)
    assert [type(m).__name__ for m in net][::2] == ["TTLinear", "Linear", "Linear"]


@pytest.mark.parametrize("threshold", [1.0, 5.0, 20.0])
def test_min_compression_uses_the_tt_parameter_count(threshold):
    layers = [nn.Linear(4, 4), nn.Linear(64, 128), nn.Linear(256, 512)]
    # the reference: dense weight params / TT core params of the layer that would be built
    ratios = [l.in_features * l.out_features / comera.TTLinear(l.in_features, l.out_features, rank=6).tt_params()
              for l in layers]
    net = comera.convert(nn.Sequential(*layers), rank=6, min_compression=threshold)
    got = [isinstance(m, comera.TTLinear) for m in net]
    assert got == [r >= threshold for r in ratios]
    assert any(got) and not all(got) or threshold == 1.0


def test_keeps_device_dtype_mode_and_frozen_flags():
    net = mlp(torch.float64).eval()
    net[2].weight.requires_grad_(False)
    net[2].train()                                     # a submodule left in another mode
    comera.convert(net, rank=4, min_compression=0.1)
    for i in (0, 2, 4):
        assert isinstance(net[i], comera.TTLinear)
        assert net[i].cores[0].dtype == torch.float64
        assert net[i].cores[0].device == torch.device("cpu")
    assert not net[0].training and net[2].training and not net[4].training
    assert all(not p.requires_grad for p in list(net[2].cores) + list(net[2].gates))
    assert all(p.requires_grad for p in net[0].cores)


def test_bfloat16_linear_gets_bfloat16_cores_and_keeps_bf16_activations():
    net = mlp(torch.bfloat16)
    comera.convert(net, rank=4, min_compression=0.1)
    assert net[0].cores[0].dtype == torch.bfloat16
    y = net(torch.randn(3, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_shared_module_is_replaced_everywhere_by_one_layer():
    shared = nn.Linear(64, 64)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    comera.convert(net, rank=4)
    assert isinstance(net[0], comera.TTLinear) and net[0] is net[2]


def test_bare_layer_returns_the_tt_layer():
    lin = nn.Linear(64, 32)
    tt = comera.convert(lin, rank=4, init="svd")
    assert isinstance(tt, comera.TTLinear) and tt.bias is lin.bias


def test_subclasses_stay_dense():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    net = nn.Sequential(MyLinear(64, 64), nn.Linear(64, 64))
    comera.convert(net, rank=4)
    assert type(net[0]) is MyLinear and isinstance(net[1], comera.TTLinear)


def test_logs_a_summary(caplog):
    with caplog.at_level(logging.INFO, logger="comera"):
        comera.convert(mlp(), rank=4, exclude="4")
    text = caplog.text
    assert "2 of 3 Linear/Embedding layers converted" in text
    assert "excluded by '4'" in text and "converted layers:" in text


def test_include_pattern_matching_nothing_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="comera"):
        comera.convert(mlp(), rank=4, include=["encoder.*"])
    assert "matches no Linear/Embedding layer" in caplog.text


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(rank=0), ValueError, "rank"),
    (dict(rank="8"), ValueError, "rank"),
    (dict(rank={"*": -1}), ValueError, "rank"),
    (dict(rank=4, init="xavier"), ValueError, "init"),
    (dict(rank=4, tie="break"), ValueError, "tie"),
    (dict(rank=4, include=3), TypeError, "include"),
    (dict(rank=4, exclude=[1]), TypeError, "exclude"),
    (dict(rank=4, min_compression=0), ValueError, "min_compression"),
    (dict(rank=4, embeddings="yes"), TypeError, "embeddings"),
    (dict(rank=[2, 2]), ValueError, "'0'"),       # wrong number of bonds names the layer
])
def test_bad_arguments_raise_clear_errors(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        comera.convert(mlp(), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model"):
        comera.convert("bert", rank=4)
    with pytest.raises(TypeError, match="model"):
        comera.to_dense(None)


# ------------------------------------------------------------------ embeddings
def test_embedding_svd_full_rank_is_exact_and_keeps_padding_idx():
    torch.manual_seed(0)
    emb = nn.Embedding(60, 12, padding_idx=3, dtype=torch.float64)
    net = nn.Sequential(emb)
    comera.convert(net, rank=10_000, init="svd", min_compression=0.01)
    tt = net[0]
    assert isinstance(tt, comera.TTEmbedding) and tt.padding_idx == 3
    assert tt.cores[0].dtype == torch.float64
    idx = torch.tensor([[0, 3, 59], [7, 7, 1]])
    torch.testing.assert_close(tt(idx), emb(idx), atol=1e-10, rtol=1e-10)
    dense = comera.to_dense(net)[0]
    assert type(dense) is nn.Embedding and dense.padding_idx == 3
    torch.testing.assert_close(dense.weight, emb.weight, atol=1e-10, rtol=1e-10)


def test_embedding_random_init_and_selection_flags():
    net = nn.ModuleDict({"tok": nn.Embedding(1000, 64), "pos": nn.Embedding(4, 64),
                         "bag": nn.Embedding(1000, 64, sparse=True), "proj": nn.Linear(64, 64)})
    comera.convert(net, rank=8)
    assert isinstance(net["tok"], comera.TTEmbedding)
    assert type(net["pos"]) is nn.Embedding            # 4 x 64 does not compress at rank 8
    assert type(net["bag"]) is nn.Embedding            # sparse gradients: not supported
    w = net["tok"].weight.detach()
    assert 0.5 < w.var().item() < 2.0                   # nn.Embedding's N(0, 1) variance
    net2 = nn.ModuleDict({"tok": nn.Embedding(1000, 64), "proj": nn.Linear(64, 64)})
    comera.convert(net2, rank=8, embeddings=False)
    assert type(net2["tok"]) is nn.Embedding and isinstance(net2["proj"], comera.TTLinear)


# ------------------------------------------------------------------- to_dense
def test_to_dense_inverts_convert():
    net = comera.convert(mlp(torch.float64), rank=4, min_compression=0.1)
    x = torch.randn(6, 64, dtype=torch.float64)
    y = net(x)
    biases = [net[i].bias for i in (0, 2, 4)]
    comera.to_dense(net)
    assert all(type(net[i]) is nn.Linear for i in (0, 2, 4))
    assert all(net[i].bias is b for i, b in zip((0, 2, 4), biases))
    assert net[0].weight.dtype == torch.float64
    torch.testing.assert_close(net(x), y, atol=1e-10, rtol=1e-10)


def test_to_dense_of_a_bare_tt_layer():
    tt = comera.TTLinear(32, 16, rank=3)
    lin = comera.to_dense(tt)
    assert type(lin) is nn.Linear
    torch.testing.assert_close(lin.weight, tt.weight)


# ------------------------------------------------------------- weight ties
def _tied_linears(same_bias=True):
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    b.weight = a.weight
    if same_bias:
        b.bias = a.bias
    return nn.Sequential(a, nn.Tanh(), b)


def test_tied_linears_share_one_tt_layer():
    net = comera.convert(_tied_linears(), rank=4)
    assert isinstance(net[0], comera.TTLinear) and net[0] is net[2]


def test_tied_linears_with_own_biases_stay_dense_and_tied(caplog):
    net = _tied_linears(same_bias=False)
    with caplog.at_level(logging.INFO, logger="comera"):
        comera.convert(net, rank=4)
    assert type(net[0]) is nn.Linear and net[0].weight is net[2].weight
    assert "tie='untie'" in caplog.text


def test_untie_converts_tied_layers_separately_with_a_warning(caplog):
    net = _tied_linears()
    with caplog.at_level(logging.WARNING, logger="comera"):
        comera.convert(net, rank=4, tie="untie", init="svd")
    assert isinstance(net[0], comera.TTLinear) and isinstance(net[2], comera.TTLinear)
    assert net[0] is not net[2]
    assert net[0].cores[0] is not net[2].cores[0]
    assert "untying" in caplog.text


def test_weight_shared_with_another_kind_of_module_stays_dense(caplog):
    class Scale(nn.Module):                  # uses the Linear's weight in its own way
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, x):
            return x * self.w.sum()

    lin = nn.Linear(64, 64)
    net = nn.Sequential(lin, Scale(lin.weight))
    with caplog.at_level(logging.INFO, logger="comera"):
        comera.convert(net, rank=4)
    assert net[0] is lin and net[1].w is lin.weight
    assert "weight also held by 1.w" in caplog.text
    comera.convert(net, rank=4, tie="untie")
    assert isinstance(net[0], comera.TTLinear)


def test_skip_leaves_tied_layers_dense():
    net = comera.convert(_tied_linears(), rank=4, tie="skip")
    assert type(net[0]) is nn.Linear and net[0].weight is net[2].weight


# -------------------------------------------------------- nn.TransformerEncoder
def test_transformer_encoder_converts_ffn_and_leaves_mha_projections(caplog):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0,
                                       batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double()
    x = torch.randn(3, 10, 64, dtype=torch.float64)
    ref = enc(x)
    with caplog.at_level(logging.INFO, logger="comera"):
        comera.convert(enc, rank=10_000, init="svd", min_compression=0.01)
    for blk in enc.layers:
        assert isinstance(blk.linear1, comera.TTLinear) and isinstance(blk.linear2, comera.TTLinear)
        assert type(blk.self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
        assert isinstance(blk.self_attn.in_proj_weight, nn.Parameter)
    assert "nn.MultiheadAttention" in caplog.text
    torch.testing.assert_close(enc(x), ref, atol=1e-9, rtol=1e-9)  # full-rank svd: same function
    enc(x).sum().backward()
    assert all(c.grad is not None for c in enc.layers[0].linear1.cores)


# ---------------------------------------------------------- HF transformers
def _bert(kind="bert", layers=2):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=40, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**common))
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(pad_token_id=1, **common))


def _prefix(kind):
    return "bert" if kind == "bert" else "roberta"


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_hf_masked_lm_full_rank_svd_is_the_same_model(kind):
    torch.manual_seed(0)
    model = _bert(kind).double().eval()
    ids = torch.randint(3, 300, (2, 12))
    ref = model(input_ids=ids).logits
    comera.convert(model, rank=10_000, init="svd", embeddings=False, min_compression=0.01)
    p = _prefix(kind)
    enc = getattr(model, p).encoder.layer[0]
    assert isinstance(enc.attention.self.query, comera.TTLinear)
    assert isinstance(enc.intermediate.dense, comera.TTLinear)
    assert not model.training
    torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_hf_masked_lm_trains_after_convert(kind):
    torch.manual_seed(0)
    model = _bert(kind)
    comera.convert(model, rank=8, embeddings=False)
    model.train()
    ids = torch.randint(3, 300, (4, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    q = getattr(model, _prefix(kind)).encoder.layer[1].attention.self.query
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in q.cores)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_hf_tied_decoder_stays_tied_when_the_embedding_stays_dense(kind, caplog):
    model = _bert(kind, layers=1)
    p = _prefix(kind)
    head = model.lm_head if kind == "roberta" else model.cls.predictions
    with caplog.at_level(logging.INFO, logger="comera"):
        comera.convert(model, rank=8, embeddings=False)
    assert type(head.decoder) is nn.Linear
    assert head.decoder.weight is getattr(model, p).embeddings.word_embeddings.weight
    assert "tie='untie'" in caplog.text                  # the summary tells how to change it
    assert model.config.tie_word_embeddings               # nothing was untied


def test_hf_untie_converts_the_decoder_and_updates_the_config():
    model = _bert("bert", layers=1)
    caller_config = model.config
    word = model.bert.embeddings.word_embeddings
    comera.convert(model, rank=8, embeddings=False, tie="untie", include=["cls.*"])
    assert caller_config.tie_word_embeddings is True      # the caller's config object is untouched
    assert model.config is not caller_config and model.bert.config is model.config
    assert isinstance(model.cls.predictions.decoder, comera.TTLinear)
    assert model.bert.embeddings.word_embeddings is word and type(word) is nn.Embedding
    assert model.config.tie_word_embeddings is False
    assert "cls.predictions.decoder.weight" not in model.all_tied_weights_keys
    # the decoder bias is still BERT's cls.predictions.bias (that tie is untouched)
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    model(input_ids=torch.randint(0, 300, (2, 8))).logits.sum().backward()
    comera.to_dense(model)
    assert type(model.cls.predictions.decoder) is nn.Linear
    assert model.config.tie_word_embeddings is True
    assert "cls.predictions.decoder.weight" in model.all_tied_weights_keys


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_hf_tie_is_kept_with_tt_embeddings(kind):
    torch.manual_seed(0)
    model = _bert(kind, layers=1)
    p = _prefix(kind)
    head = model.lm_head if kind == "roberta" else model.cls.predictions
    comera.convert(model, rank=8, embeddings=True, min_compression=1.0)
    word = getattr(model, p).embeddings.word_embeddings
    assert isinstance(word, comera.TTEmbedding)
    assert isinstance(head.decoder, TiedTTLinear) and head.decoder.embedding is word
    # one set of cores: the decoder's weight is the embedding's table, and the gradient
    # of the MLM loss reaches the embedding cores through both uses
    ids = torch.randint(3, 300, (2, 10))
    table = comera.to_dense(copy.deepcopy(word)).weight
    torch.testing.assert_close(head.decoder.weight, table, atol=1e-6, rtol=1e-5)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("cls.predictions.decoder.") and "core" in n for n in names)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(c.grad is not None for c in word.cores)
    # to_dense re-ties the decoder to the densified embedding
    comera.to_dense(model)
    word = getattr(model, p).embeddings.word_embeddings
    assert type(word) is nn.Embedding and head.decoder.weight is word.weight
    assert model.config.tie_word_embeddings is True


# ----------------------------------------- TiedTTLinear (against a stand-in TTM)
def test_tied_tt_linear_uses_the_embedding_table_and_trains_its_cores():
    emb = StandInTTM(22, 12, [2, 3, 4], [2, 3, 2], [3, 2])        # 24 rows padded to 22
    bias = nn.Parameter(torch.randn(22, dtype=torch.float64))
    head = TiedTTLinear(emb, bias=bias)
    assert [n for n, _ in head.named_parameters()] == ["bias"]      # the cores are not registered twice
    assert list(head.state_dict()) == ["bias"]
    table = table_by_entries(emb)
    torch.testing.assert_close(head.weight, table)
    x = torch.randn(5, 12, dtype=torch.float64)
    y = head(x)
    torch.testing.assert_close(y, x @ table.t() + bias)
    y.square().sum().backward()
    ref = StandInTTM(22, 12, [2, 3, 4], [2, 3, 2], [3, 2])
    with torch.no_grad():
        for p, q in zip(list(ref.cores) + list(ref.gates), list(emb.cores) + list(emb.gates)):
            p.copy_(q)
    (x @ table_by_entries(ref).t() + bias.detach()).square().sum().backward()
    for c, r in zip(list(emb.cores) + list(emb.gates), list(ref.cores) + list(ref.gates)):
        torch.testing.assert_close(c.grad, r.grad)


def test_tied_tt_linear_rejects_bad_input():
    head = TiedTTLinear(StandInTTM(8, 4, [2, 4], [2, 2], [2]))
    with pytest.raises(ValueError, match="in_features=4"):
        head(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="TT embedding"):
        TiedTTLinear(nn.Embedding(8, 4))
