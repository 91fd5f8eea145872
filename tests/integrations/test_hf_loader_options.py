"""comera.from_pretrained with transformers' loader options (dtype and half
precision of tied heads, config=, state_dict=, output_loading_info,
ignore_mismatched_sizes, low_cpu_mem_usage, device_map, the meta-device
refusal, unknown options) and base/head checkpoints, each against an
independent reference: the saved model's own tensors and outputs, the float32
load cast afterwards, the values transformers' own loader gives a dense model."""
import pytest
import torch

import comera
from comera.convert import converted_layers
from comera.layers.base import tt_layers
from comera.layers.tied import TiedTTLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hf_tiny import quiet, tiny_config  # noqa: E402
from transformers.testing_utils import CaptureLogger  # noqa: E402

V = 120


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with quiet(transformers):
        yield


def _config(kind="bert", **kw):
    return tiny_config(transformers, kind, **dict(dict(vocab_size=V), **kw))


HEADS = [("bert", "BertForMaskedLM", {}), ("bert", "BertLMHeadModel", {"is_decoder": True}),
         ("roberta", "RobertaForCausalLM", {"is_decoder": True}), ("roberta", "RobertaForMaskedLM", {})]


def _ids(vocab=V):
    return torch.randint(2, vocab, (2, 9), generator=torch.Generator().manual_seed(1))


def _saved(folder, cls, config, dtype=torch.float32, **convert_kw):
    torch.manual_seed(0)
    model = comera.convert(cls(config).to(dtype), rank=convert_kw.pop("rank", 6), **convert_kw).eval()
    model.save_pretrained(folder)
    return model


def _assert_same_state(a, b, keys=None):
    sa, sb = a.state_dict(), b.state_dict()
    keys = sa.keys() if keys is None else keys
    for k in keys:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# ------------------------------------------------------------------- dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind,name,extra", HEADS, ids=[h[1] for h in HEADS])
def test_half_precision_loads_tied_heads_as_the_float32_load_cast_afterwards(tmp_path, kind, name,
                                                                            extra, dtype):
    cls = getattr(transformers, name)
    _saved(tmp_path, cls, _config(kind, **extra))
    half = comera.from_pretrained(cls, tmp_path, dtype=dtype)
    head = half.get_output_embeddings()
    assert isinstance(head, TiedTTLinear) and head.embedding is half.get_input_embeddings()
    assert all(p.dtype == dtype for p in half.parameters())
    ref = comera.from_pretrained(cls, tmp_path).to(dtype)      # the workaround users had
    _assert_same_state(half, ref)
    with torch.no_grad():
        out, expected = half(_ids()).logits, ref(_ids()).logits
    assert out.dtype == dtype and torch.equal(out, expected)
    by_name = comera.from_pretrained(cls, tmp_path, dtype=str(dtype).replace("torch.", ""))
    _assert_same_state(by_name, half)


def test_convert_keeps_half_precision_ties_and_they_train():
    model = transformers.BertForMaskedLM(_config()).to(torch.bfloat16)
    comera.convert(model, rank=4)
    head, emb = model.cls.predictions.decoder, model.bert.embeddings.word_embeddings
    assert isinstance(head, TiedTTLinear) and head.embedding is emb
    assert emb.cores[0].dtype == torch.bfloat16
    loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in emb.cores)


def test_dtype_auto_none_names_and_torch_dtype(tmp_path):
    bf16 = _saved(tmp_path, transformers.BertForMaskedLM, _config(), dtype=torch.bfloat16)
    assert transformers.AutoConfig.from_pretrained(tmp_path).dtype == torch.bfloat16
    for kwargs in ({}, {"dtype": "auto"}, {"dtype": None}, {"torch_dtype": "auto"}):
        loaded = comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, **kwargs)
        _assert_same_state(loaded, bf16)                      # the config's dtype
    wide = comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, torch_dtype=torch.float32)
    assert wide.bert.embeddings.word_embeddings.cores[0].dtype == torch.float32
    both = comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, dtype="float64",
                                  torch_dtype=torch.float32)  # dtype wins, as in transformers
    assert both.bert.encoder.layer[0].output.dense.cores[0].dtype == torch.float64
    with pytest.raises(ValueError, match="dtype"):
        comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, dtype="int8")
    # no dtype in the config: "auto" takes the stored tensors' dtype
    state = {k: v.to(torch.float64) if v.is_floating_point() else v
             for k, v in bf16.state_dict().items()}
    config = _config()
    config.dtype = None
    auto = comera.from_pretrained(transformers.BertForMaskedLM, config=config, state_dict=state,
                                  dtype="auto")
    assert auto.bert.embeddings.word_embeddings.cores[0].dtype == torch.float64


# ---------------------------------------------------------- config= and kwargs
def test_config_object_path_and_keyword_arguments(tmp_path):
    model = _saved(tmp_path, transformers.BertModel, _config())
    config = transformers.BertConfig.from_pretrained(tmp_path)
    config.hidden_dropout_prob = 0.3
    loaded = comera.from_pretrained(transformers.BertModel, tmp_path, config=config)
    assert loaded.config.hidden_dropout_prob == 0.3 and config.hidden_dropout_prob == 0.3
    assert not hasattr(loaded.config, "comera")               # the record describes the folder
    _assert_same_state(loaded, model)
    # with config=, keyword arguments go to __init__ (transformers' rule)
    no_pool, info = comera.from_pretrained(transformers.BertModel, tmp_path, config=config,
                                           add_pooling_layer=False, output_loading_info=True)
    assert no_pool.pooler is None
    assert info["unexpected_keys"] == {k for k in model.state_dict() if k.startswith("pooler.")}
    # without it, config attributes override and __init__ arguments pass on
    loaded = comera.from_pretrained(transformers.BertModel, tmp_path, attention_probs_dropout_prob=0.2,
                                    add_pooling_layer=False)
    assert loaded.config.attention_probs_dropout_prob == 0.2 and loaded.pooler is None
    from_folder = comera.from_pretrained(transformers.BertModel, tmp_path, config=str(tmp_path))
    _assert_same_state(from_folder, model)
    with pytest.raises(TypeError, match=r"\['bogus', 'other'\]"):
        comera.from_pretrained(transformers.BertModel, tmp_path, bogus=1, other=2)
    with pytest.raises(TypeError, match=r"\['bogus'\]"):
        comera.from_pretrained(transformers.BertModel, tmp_path, config=config, bogus=1)


def test_low_cpu_mem_usage_is_accepted(tmp_path):
    model = _saved(tmp_path, transformers.BertForMaskedLM, _config())
    for flag in (True, False, None):
        _assert_same_state(comera.from_pretrained(transformers.BertForMaskedLM, tmp_path,
                                                  low_cpu_mem_usage=flag), model)


# --------------------------------------------------------------- devices
def test_device_map_for_one_device_and_refusals(tmp_path):
    model = _saved(tmp_path, transformers.BertForMaskedLM, _config())
    for kwargs in ({"device_map": "cpu"}, {"device_map": {"": "cpu"}},
                   {"device_map": torch.device("cpu")}, {"device": "cpu"},
                   {"device_map": {"bert": "cpu", "cls": "cpu"}}):
        loaded = comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, **kwargs)
        assert all(t.device.type == "cpu" for t in loaded.state_dict().values())
        _assert_same_state(loaded, model)
    for device_map in ("auto", "balanced", {"bert": "cpu", "cls": "cuda:0"}):
        with pytest.raises(ValueError, match="one device"):
            comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, device_map=device_map)
    with pytest.raises(TypeError, match="not both"):
        comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, device="cpu", device_map="cpu")


def test_refuses_to_load_under_a_meta_device_context(tmp_path):
    _saved(tmp_path, transformers.BertForMaskedLM, _config())
    plain = tmp_path / "plain"
    transformers.BertForMaskedLM(_config()).save_pretrained(plain)
    with torch.device("meta"):
        with pytest.raises(RuntimeError, match="meta device context manager") as ours:
            comera.from_pretrained(transformers.BertForMaskedLM, tmp_path)
        with pytest.raises(RuntimeError, match="meta device context manager") as theirs:
            transformers.BertForMaskedLM.from_pretrained(plain)
    assert str(ours.value) == str(theirs.value)               # transformers' own message
    with torch.device("cpu"):
        assert comera.from_pretrained(transformers.BertForMaskedLM, tmp_path) is not None


# ----------------------------------------------------------- state_dict=
@pytest.mark.parametrize("convert_kw", [
    dict(rank=6), dict(rank=5, tie="untie"), dict(rank=4, include="bert.encoder.*")],
    ids=["tied", "untied", "partial"])
def test_state_dict_of_a_converted_model_loads_exactly(convert_kw):
    torch.manual_seed(0)
    model = comera.convert(transformers.BertForMaskedLM(_config()), **convert_kw).eval()
    with torch.no_grad():
        for _, layer in tt_layers(model):
            layer.gates[0][1:] = 0                            # prune: ranks other than built
    comera.prune(model)
    loaded, info = comera.from_pretrained(transformers.BertForMaskedLM, config=model.config,
                                          state_dict=model.state_dict(), output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}
    assert {n: type(m) for n, m in converted_layers(loaded)} == \
        {n: type(m) for n, m in converted_layers(model)}
    _assert_same_state(loaded, model)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)


def test_state_dict_with_a_config_that_carries_the_record(tmp_path):
    model = _saved(tmp_path, transformers.BertForMaskedLM, _config())
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert "layers" in config.comera
    loaded = comera.from_pretrained(transformers.AutoModelForMaskedLM, config=config,
                                    state_dict=model.state_dict())
    _assert_same_state(loaded, model)
    with pytest.raises(ValueError, match="state_dict"):
        comera.from_pretrained(transformers.BertForMaskedLM, tmp_path, state_dict=model.state_dict())
    with pytest.raises(TypeError, match="state_dict"):
        comera.from_pretrained(transformers.BertForMaskedLM, config=config)


# ---------------------------------------------------- base and head folders
def test_base_folder_into_head_model_and_back(tmp_path):
    base = _saved(tmp_path / "base", transformers.BertModel, _config())
    head, info = comera.from_pretrained(transformers.BertForMaskedLM, tmp_path / "base",
                                        output_loading_info=True)
    ref = transformers.BertForMaskedLM(_config())             # the names transformers expects
    expected_missing = {k for k in ref.state_dict() if k.startswith("cls.")}
    expected_missing -= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert info["missing_keys"] == expected_missing
    # a masked-LM's BERT has no pooler: the base's pooler is unexpected, as transformers says
    assert info["unexpected_keys"] == {f"bert.{k}" for k in base.state_dict() if k.startswith("pooler.")}
    # the base's values, under the prefix, exactly
    sb, sh = base.state_dict(), head.state_dict()
    for k, v in sb.items():
        if not k.startswith("pooler."):
            assert torch.equal(sh[f"bert.{k}"], v), k
    # the head the folder lacks is initialised as transformers does (N(0, 0.02^2), LayerNorm 1)
    assert isinstance(head.cls.predictions.decoder, TiedTTLinear)
    dense = head.cls.predictions.transform.dense
    assert type(dense) is torch.nn.Linear and 0.01 < dense.weight.std().item() < 0.03
    assert torch.equal(head.cls.predictions.transform.LayerNorm.weight, torch.ones(32))
    assert torch.equal(head.cls.predictions.bias, torch.zeros(V))

    mlm = _saved(tmp_path / "mlm", transformers.BertForMaskedLM, _config())
    back, info = comera.from_pretrained(transformers.BertModel, tmp_path / "mlm",
                                        output_loading_info=True)
    assert info["unexpected_keys"] == {k for k in mlm.state_dict() if k.startswith("cls.")} - \
        {"cls.predictions.decoder.bias"}
    assert info["missing_keys"] == {k for k in back.state_dict() if k.startswith("pooler.")}
    for k, v in back.state_dict().items():
        if not k.startswith("pooler."):
            assert torch.equal(v, mlm.state_dict()[f"bert.{k}"]), k

    clf, info = comera.from_pretrained(transformers.BertForSequenceClassification, tmp_path / "mlm",
                                       num_labels=3, output_loading_info=True)
    assert {"classifier.weight", "classifier.bias"} <= info["missing_keys"]
    assert type(clf.classifier) is torch.nn.Linear and torch.isfinite(clf.classifier.weight).all()
    assert isinstance(clf.bert.encoder.layer[0].output.dense, comera.TTLinear)


def test_ignore_mismatched_sizes(tmp_path):
    cls = transformers.BertForSequenceClassification
    model = _saved(tmp_path, cls, _config(num_labels=3), min_compression=1e-9)
    assert isinstance(model.classifier, comera.TTLinear)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        comera.from_pretrained(cls, tmp_path, num_labels=5)
    logger = transformers.logging.get_logger("transformers.modeling_utils")
    transformers.logging.set_verbosity_warning()
    with CaptureLogger(logger) as cl:
        new, info = comera.from_pretrained(cls, tmp_path, num_labels=5, ignore_mismatched_sizes=True,
                                           output_loading_info=True)
    assert "Reinit due to size mismatch" in cl.out
    names = {k for k, _, _ in info["mismatched_keys"]}
    assert names == {k for k in model.state_dict() if k.startswith("classifier.")}
    assert new.classifier.out_features == 5
    # a TT layer of another output size may have more cores than the stored one: those are missing
    assert {k.split(".")[0] for k in info["missing_keys"]} <= {"classifier"}
    assert all(torch.isfinite(p).all() for p in new.classifier.parameters())
    with torch.no_grad():
        assert new(_ids()).logits.shape == (2, 5)
    kept = [k for k in model.state_dict() if not k.startswith("classifier.")]
    _assert_same_state(new, model, kept)
