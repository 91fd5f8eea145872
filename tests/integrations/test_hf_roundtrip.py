"""Hugging Face save_pretrained / comera.from_pretrained round trips of converted
models (tiny BERT and RoBERTa built from configs, no download): same logits after
a reload, pruned ranks kept, plain from_pretrained refusing the folder, and the
to_dense export that plain from_pretrained loads."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import comera
from comera.convert import converted_layers
from comera.integrations.hf.pretrained import SavePretrained
from comera.layers.base import tt_layers
from comera.layers.tied import TiedTTLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hf_tiny import quiet  # noqa: E402

V = 300


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with quiet(transformers):
        yield


def _model(kind="bert"):
    common = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=40)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**common))
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(pad_token_id=1, **common))


def _ids():
    return torch.randint(2, V, (3, 12), generator=torch.Generator().manual_seed(5))


def _train_step(model):
    """One AdamW step with dropout on: every value moves away from its init."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model.eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _assert_same_model(loaded, model):
    """Same class, TT layer types and ranks, every state tensor equal, same logits."""
    assert type(loaded) is type(model) and not loaded.training
    ours = {n: type(m).__name__ for n, m in converted_layers(model)}
    theirs = {n: type(m).__name__ for n, m in converted_layers(loaded)}
    assert theirs == ours
    assert comera.storage.tt_shapes(loaded) == comera.storage.tt_shapes(model)
    sd, ref = loaded.state_dict(), model.state_dict()
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    assert torch.equal(_logits(loaded), _logits(model))


def _config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("kind,auto", [("bert", True), ("roberta", False)])
def test_trained_model_round_trips_exactly(tmp_path, kind, auto):
    model = _train_step(comera.convert(_model(kind), rank=8))
    model.save_pretrained(tmp_path)

    assert sorted(os.listdir(tmp_path)) == ["comera-model.safetensors", "config.json"]
    cfg = _config(tmp_path)
    layers = cfg["comera"]["layers"]
    prefix = "bert" if kind == "bert" else "roberta"
    assert layers["cls.predictions.decoder" if kind == "bert" else "lm_head.decoder"] == {
        "type": "TiedTTLinear", "embedding": f"{prefix}.embeddings.word_embeddings"}
    assert layers[f"{prefix}.encoder.layer.1.output.dense"]["type"] == "TTLinear"
    assert cfg["tie_word_embeddings"] is True            # the architecture as built, not the private copy
    assert cfg["comera"]["class"] == type(model).__name__

    cls = transformers.AutoModelForMaskedLM if auto else type(model)
    loaded = comera.from_pretrained(cls, tmp_path)
    _assert_same_model(loaded, model)
    head = loaded.cls.predictions.decoder if kind == "bert" else loaded.lm_head.decoder
    emb = getattr(loaded, prefix).embeddings.word_embeddings
    assert isinstance(head, TiedTTLinear) and head.embedding is emb      # tied again
    assert head.bias is (loaded.cls.predictions.bias if kind == "bert" else loaded.lm_head.bias)
    assert isinstance(loaded.__dict__["save_pretrained"], SavePretrained)
    # and the loaded model trains on: gradients reach the cores of the tied embedding
    loaded.train()
    loaded(input_ids=_ids(), labels=_ids()).loss.backward()
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in emb.cores)


def test_pruned_ranks_round_trip_and_resaving_the_loaded_model(tmp_path):
    model = comera.convert(_model(), rank=8)
    with torch.no_grad():
        for _, layer in tt_layers(model):
            layer.gates[0][1:] = 0                           # kill all but one rank of bond 0
            layer.gates[-1][3:] = 0
    pruned = comera.prune(model)
    assert pruned and all(r[0] == 1 for r in pruned.values())
    model = _train_step(model)
    model.save_pretrained(tmp_path)
    info = _config(tmp_path)["comera"]["layers"]["bert.encoder.layer.0.intermediate.dense"]
    assert info["ranks"][0] == 1 and info["ranks"][-1] == 3 and info["live_ranks"] == info["ranks"]

    loaded = comera.from_pretrained(transformers.BertForMaskedLM, tmp_path)
    _assert_same_model(loaded, model)
    fresh = comera.storage.tt_shapes(comera.convert(_model(), rank=8))
    assert comera.storage.tt_shapes(loaded) != fresh                 # not the default ranks

    again = tmp_path / "again"
    loaded.save_pretrained(again)
    _assert_same_model(comera.from_pretrained(transformers.AutoModelForMaskedLM, again), model)


@pytest.mark.parametrize("kwargs", [
    dict(rank={"*.intermediate.*": 6, "*": 4}, embeddings=False),   # the head stays dense and tied
    dict(rank=5, tie="untie"),                                        # head and embedding apart
    dict(rank=5, include="bert.encoder.*", exclude="*.attention.output.*"),
], ids=["no-embeddings", "untie", "include-exclude"])
def test_partial_and_untied_conversions_round_trip(tmp_path, kwargs):
    model = _train_step(comera.convert(_model(), **kwargs))
    model.save_pretrained(tmp_path)
    loaded = comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path)
    _assert_same_model(loaded, model)
    head = loaded.cls.predictions.decoder
    if kwargs.get("embeddings") is False:
        assert head.weight is loaded.bert.embeddings.word_embeddings.weight
    if kwargs.get("tie") == "untie":
        assert type(head) is comera.TTLinear
        assert isinstance(loaded.bert.embeddings.word_embeddings, comera.TTEmbedding)


def test_hf_loaded_model_converted_with_svd_round_trips(tmp_path):
    """A model from plain from_pretrained (built on the meta device by transformers 5,
    then filled) converts with init='svd', trains, and round trips."""
    dense = _model()
    dense.save_pretrained(tmp_path / "dense")
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "dense")
    model = _train_step(comera.convert(model, rank=6, init="svd"))
    model.save_pretrained(tmp_path / "tt")
    _assert_same_model(comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path / "tt"),
                       model)


def test_sharded_save_round_trips_and_a_later_save_leaves_no_stale_shards(tmp_path):
    model = _train_step(comera.convert(_model(), rank=8))
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.startswith("comera-model-")]
    assert len(shards) > 1 and "comera-model.safetensors.index.json" in files
    assert not any(f.startswith("model") for f in files)
    _assert_same_model(comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path), model)

    model.save_pretrained(tmp_path)                      # one file now: the shards must go
    assert sorted(os.listdir(tmp_path)) == ["comera-model.safetensors", "config.json"]
    _assert_same_model(comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path), model)


def test_dtype_and_config_overrides(tmp_path):
    model = _train_step(comera.convert(_model(), rank=8))
    model.save_pretrained(tmp_path)
    loaded = comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path,
                                    dtype=torch.float64, hidden_dropout_prob=0.25)
    assert loaded.config.hidden_dropout_prob == 0.25
    emb = loaded.bert.embeddings.word_embeddings
    assert isinstance(emb, comera.TTEmbedding) and emb.cores[0].dtype == torch.float64
    torch.testing.assert_close(_logits(loaded).float(), _logits(model), atol=1e-4, rtol=1e-4)


def test_bfloat16_model_round_trips_in_its_dtype(tmp_path):
    model = comera.convert(_model().to(torch.bfloat16), rank=8).eval()
    model.save_pretrained(tmp_path)
    loaded = comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path)
    assert loaded.bert.encoder.layer[0].output.dense.cores[0].dtype == torch.bfloat16
    _assert_same_model(loaded, model)


def test_deepcopy_keeps_the_hook_on_the_copy(tmp_path):
    model = comera.convert(_model(), rank=4)
    clone = copy.deepcopy(model)
    assert clone.__dict__["save_pretrained"].model is clone
    clone.save_pretrained(tmp_path)
    assert "comera" in _config(tmp_path)


# ------------------------------------------------------- plain transformers loads
@pytest.mark.parametrize("auto", [True, False])
def test_plain_from_pretrained_refuses_the_folder(tmp_path, auto):
    model = comera.convert(_model(), rank=8)
    model.save_pretrained(tmp_path)
    cls = transformers.AutoModelForMaskedLM if auto else transformers.BertForMaskedLM
    with pytest.raises(ValueError, match=r"comera\.from_pretrained"):
        cls.from_pretrained(tmp_path)
    # a transformers that ignores `transformers_weights` still finds no weights it can read
    cfg = _config(tmp_path)
    del cfg["transformers_weights"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(OSError, match="model.safetensors"):
        cls.from_pretrained(tmp_path)
    # the config alone stays readable (tokenizers, pipelines)
    assert transformers.AutoConfig.from_pretrained(tmp_path).vocab_size == V


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_to_dense_exports_a_plain_hf_folder(tmp_path, kind):
    model = _train_step(comera.convert(_model(kind), rank=8))
    tt_logits = _logits(model)
    dense = comera.to_dense(model)
    assert "save_pretrained" not in dense.__dict__                   # the class's own again
    dense.save_pretrained(tmp_path)
    assert "comera" not in _config(tmp_path) and "transformers_weights" not in _config(tmp_path)
    assert "model.safetensors" in os.listdir(tmp_path)
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert torch.equal(_logits(loaded), _logits(dense))
    torch.testing.assert_close(_logits(loaded), tt_logits, atol=1e-5, rtol=1e-5)
    emb = loaded.get_input_embeddings()
    assert loaded.get_output_embeddings().weight is emb.weight         # tie restored


# ------------------------------------------------------------------ bad inputs
def test_bad_inputs_give_clear_errors(tmp_path):
    register = torch.nn.Module.register_parameter
    dense = _model()
    dense.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no 'comera' entry"):
        comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        comera.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path / "nowhere")
    with pytest.raises(TypeError, match="path must be a folder path"):
        comera.from_pretrained(transformers.AutoModelForMaskedLM, 3)

    folder = tmp_path / "tt"
    comera.convert(_model(), rank=4).save_pretrained(folder)
    assert torch.nn.Module.register_parameter is register     # parameters are real again
    with pytest.raises(TypeError, match="cls must be a transformers model class"):
        comera.from_pretrained(torch.nn.Linear, folder)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['not_an_option'\]"):
        comera.from_pretrained(transformers.AutoModelForMaskedLM, folder, not_an_option=1)
    with pytest.raises(ValueError, match="push_to_hub"):
        comera.convert(_model(), rank=4).save_pretrained(tmp_path / "hub", push_to_hub=True)
    os.unlink(folder / "comera-model.safetensors")
    with pytest.raises(FileNotFoundError, match="comera-model.safetensors"):
        comera.from_pretrained(transformers.AutoModelForMaskedLM, folder)


def test_import_comera_does_not_import_transformers():
    code = "import sys, comera; assert 'transformers' not in sys.modules; comera.from_pretrained"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
