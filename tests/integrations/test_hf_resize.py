"""resize_token_embeddings on converted transformers models: kept rows
bit-exact (against the values before resizing), the tied head following,
untied TT and dense heads, pad_to_multiple_of, shrinking, training and
saving afterwards; get/set_input_embeddings and get_output_embeddings as
transformers uses them."""
import copy

import pytest
import torch

import comera
from comera.layers.tied import TiedTTLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hf_tiny import quiet, tiny_config  # noqa: E402

V, H = 99, 32


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with quiet(transformers):
        yield


def _config(kind="bert", **kw):
    return tiny_config(transformers, kind, **dict(dict(vocab_size=V, hidden_size=H, num_hidden_layers=1), **kw))


HEADS = [("bert", "BertForMaskedLM", {}), ("bert", "BertLMHeadModel", {"is_decoder": True}),
         ("roberta", "RobertaForCausalLM", {"is_decoder": True}), ("roberta", "RobertaForMaskedLM", {})]


def _model(kind="bert", name="BertForMaskedLM", rank=6, **kw):
    torch.manual_seed(0)
    model = getattr(transformers, name)(_config(kind, **kw))
    return comera.convert(model, rank=rank).eval()


def _ids(high, seed=2):
    return torch.randint(2, high, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind,name,extra", HEADS, ids=[h[1] for h in HEADS])
def test_kept_rows_stay_bit_exact_and_the_tied_head_follows(kind, name, extra):
    model = _model(kind, name, **extra)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, comera.TTEmbedding) and isinstance(head, TiedTTLinear)
    rows = torch.arange(V)
    table, lookups = emb.weight.detach().clone(), emb(rows).detach().clone()
    bias = head.bias.detach().clone()
    with torch.no_grad():
        logits = model(input_ids=_ids(V)).logits

    out = model.resize_token_embeddings(V + 10)
    assert out is emb and model.get_input_embeddings() is emb       # the same TTEmbedding
    assert emb.num_embeddings == V + 10 and emb.weight.shape == (V + 10, H)
    assert model.config.vocab_size == V + 10 and model.vocab_size == V + 10
    assert torch.equal(emb.weight[:V], table)                       # kept rows, bit for bit
    assert torch.equal(emb(rows), lookups)
    head = model.get_output_embeddings()
    assert isinstance(head, TiedTTLinear) and head.embedding is emb and head.out_features == V + 10
    assert torch.equal(head.weight, emb.weight)
    assert head.bias.shape == (V + 10,) and torch.equal(head.bias[:V], bias)
    assert torch.allclose(head.bias[V:], bias.mean().expand(10))    # transformers: the old mean
    with torch.no_grad():
        grown = model(input_ids=_ids(V)).logits
        assert grown.shape[-1] == V + 10
        torch.testing.assert_close(grown[..., :V], logits, atol=1e-6, rtol=1e-6)
        assert torch.isfinite(model(input_ids=_ids(V + 10, seed=3)).logits).all()

    model.resize_token_embeddings(V - 15)                           # and shrink
    assert torch.equal(emb.weight, table[:V - 15]) and head.bias.shape == (V - 15,)
    assert torch.equal(head.bias, bias[:V - 15])
    with torch.no_grad():
        assert model(input_ids=_ids(V - 15)).logits.shape[-1] == V - 15


def test_added_rows_fit_the_old_mean_and_padding_rows_keep_their_values():
    model = _model()
    emb = model.get_input_embeddings()
    space = emb.row_shape[0] * emb.row_shape[1] * emb.row_shape[2]   # 100 rows for 99 tokens
    before = emb.weight.detach().clone()
    full = comera.ops.dense.ttm_full(list(emb.cores), list(emb.gates)).detach()
    model.resize_token_embeddings(130)
    after = emb.weight.detach()
    mean = before.mean(0)
    # a row in the padding of the old row space reads what the cores gave there
    assert torch.equal(after[V:space], full[V:space, :H])
    # rows of the added slices of core 0: the least-squares fit to the old mean
    new = after[space:]
    spread = (before - mean).norm(dim=1).mean()
    assert (new - mean).norm(dim=1).mean() < 0.5 * spread
    # mean_resizing=False: random slices, rows with the old rows' scale
    model = _model()
    model.resize_token_embeddings(130, mean_resizing=False)
    rand = model.get_input_embeddings().weight.detach()[space:]
    assert 0.2 < rand.std().item() / before.std().item() < 5


def test_pad_to_multiple_of_and_a_vocabulary_below_the_hidden_size():
    model = _model()
    emb = model.resize_token_embeddings(V + 10, pad_to_multiple_of=64)
    assert emb.weight.shape[0] == 128 and model.config.vocab_size == 128
    emb = model.resize_token_embeddings(pad_to_multiple_of=48)       # pad the current size only
    assert emb.weight.shape[0] == 144
    assert model.resize_token_embeddings() is emb and emb.num_embeddings == 144
    with pytest.raises(ValueError, match="which is not and integer"):
        model.resize_token_embeddings(V, pad_to_multiple_of=1.3)     # transformers' message

    small = _model(vocab_size=4, pad_token_id=3)
    emb = small.get_input_embeddings()
    table = emb.weight.detach().clone()
    assert torch.equal(table[3], torch.zeros(H))                    # the padding row
    small.resize_token_embeddings(14)
    assert torch.equal(emb.weight[:4], table) and emb.weight.shape == (14, H)
    with torch.no_grad():
        assert small(input_ids=_ids(14)).logits.shape[-1] == 14


def test_roberta_padding_row_stays_zero_and_shrinking_past_it_is_refused():
    model = _model("roberta", "RobertaForMaskedLM")
    emb = model.get_input_embeddings()
    model.resize_token_embeddings(V + 20)
    assert emb.padding_idx == 1 and torch.equal(emb.weight[1], torch.zeros(H))
    with pytest.raises(ValueError, match="padding_idx"):
        emb.resize_rows_(1)


def test_untied_tt_head_grows_with_its_kept_rows_exact():
    model = _model(tie_word_embeddings=False)
    head = model.get_output_embeddings()
    assert type(head) is comera.TTLinear
    weight, bias = head.weight.detach().clone(), head.bias.detach().clone()
    with torch.no_grad():
        logits = model(input_ids=_ids(V)).logits
    model.resize_token_embeddings(V + 10)
    head = model.get_output_embeddings()
    assert head.out_features == V + 10 and head.weight.shape == (V + 10, H)
    assert torch.equal(head.weight[:V], weight)
    assert torch.equal(head.bias[:V], bias) and model.cls.predictions.bias is head.bias
    with torch.no_grad():
        grown = model(input_ids=_ids(V)).logits
    # the kernels may sum in another order for the larger output: equal up to rounding
    torch.testing.assert_close(grown[..., :V], logits, atol=1e-5, rtol=1e-5)
    # the layer computes what its weight says, padding in the leading output mode included
    x = torch.randn(3, H)
    torch.testing.assert_close(head(x), x @ head.weight.T + head.bias, atol=1e-5, rtol=1e-5)
    model.resize_token_embeddings(V - 15)
    assert torch.equal(model.get_output_embeddings().weight, weight[:V - 15])


def test_dense_embeddings_resize_as_transformers_does():
    torch.manual_seed(0)
    model = comera.convert(transformers.BertForMaskedLM(_config()), rank=6, embeddings=False)
    ref = copy.deepcopy(model)
    transformers.BertForMaskedLM.resize_token_embeddings(ref, V + 10, mean_resizing=False)
    torch.manual_seed(0)
    model.resize_token_embeddings(V + 10, mean_resizing=False)
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.testing.assert_close(model.get_input_embeddings().weight[:V],
                               ref.get_input_embeddings().weight[:V], atol=0, rtol=0)


def test_training_and_saving_after_a_resize(tmp_path):
    for tie in (True, False):
        model = _model(tie_word_embeddings=tie)
        model.resize_token_embeddings(V + 10)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = _ids(V + 10, seed=4)
        ids[:, 0] = V + 5                                            # a new token
        model(input_ids=ids, labels=ids).loss.backward()
        core = model.get_input_embeddings().cores[0]
        added = core.grad[:, core.shape[1] - 1]
        assert added.abs().sum() > 0                                 # the added slices train
        opt.step()
        model.eval()
        folder = tmp_path / f"tie{tie}"
        model.save_pretrained(folder)
        loaded, info = comera.from_pretrained(transformers.BertForMaskedLM, folder,
                                              output_loading_info=True)
        assert not any(info.values())
        assert loaded.get_input_embeddings().row_shape == model.get_input_embeddings().row_shape
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_get_and_set_embeddings_and_the_hook():
    model = _model()
    emb = comera.TTEmbedding(V, H, rank=3)
    model.set_input_embeddings(emb)
    assert model.get_input_embeddings() is emb and model.bert.embeddings.word_embeddings is emb
    with torch.no_grad():
        assert model(input_ids=_ids(V)).logits.shape[-1] == V
    # the head stays tied to the embedding it was converted with, which resizing then refuses
    with pytest.raises(ValueError, match="tied to another embedding"):
        model.resize_token_embeddings(V + 3)
    model = _model()
    clone = copy.deepcopy(model)
    clone.resize_token_embeddings(V + 3)                             # the copy's own hook
    assert clone.config.vocab_size == V + 3 and model.config.vocab_size == V
    assert model.get_input_embeddings().num_embeddings == V
    dense = comera.to_dense(_model())
    assert "resize_token_embeddings" not in dense.__dict__           # the class's own again
    dense.resize_token_embeddings(V + 3)
    assert dense.get_input_embeddings().weight.shape[0] == V + 3


def test_gradient_checkpointing_with_input_require_grads_reaches_the_cores():
    model = _model()
    model.activation_checkpointing_enable()
    model.enable_input_require_grads()
    model.train()
    ids = _ids(V)
    model(input_ids=ids, labels=ids).loss.backward()
    cores = model.get_input_embeddings().cores
    assert all(c.grad is not None and torch.isfinite(c.grad).all() and c.grad.abs().sum() > 0
               for c in cores)
