"""Plain transformers handed comera weights (a folder, state_dict=, a config
that carries comera's record, a sub-model's folder) either loads them through
comera or raises; it never returns a model with random layers in their place."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import comera
from comera.integrations.hf import guard

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hf_tiny import quiet  # noqa: E402

V = 80
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with quiet(transformers):
        yield


def _config():
    return transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, intermediate_size=48,
                                   max_position_embeddings=24)


def _converted():
    torch.manual_seed(0)
    return comera.convert(transformers.BertForMaskedLM(_config()), rank=4).eval()


@pytest.mark.parametrize("cls", ["BertForMaskedLM", "BertModel", "BertForSequenceClassification"])
def test_plain_load_of_a_converted_state_dict_raises(cls):
    tt = _converted()
    loader = getattr(transformers, cls)
    with pytest.raises(ValueError, match=r"comera\.from_pretrained") as err:
        loader.from_pretrained(None, config=_config(), state_dict=tt.state_dict())
    assert "TTEmbedding" not in str(err.value) and "word_embeddings" in str(err.value)
    # the same weights through comera load exactly
    loaded = comera.from_pretrained(transformers.BertForMaskedLM, config=_config(),
                                    state_dict=tt.state_dict())
    for k, v in tt.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_config_with_the_record_stops_a_plain_load(tmp_path):
    tt = _converted()
    tt.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    dense = transformers.BertForMaskedLM(_config())
    for state in (tt.state_dict(), dense.state_dict()):
        with pytest.raises(ValueError, match=r"comera\.from_pretrained"):
            transformers.BertForMaskedLM.from_pretrained(None, config=config, state_dict=state)
    plain = tmp_path / "plain"
    dense.save_pretrained(plain)
    with pytest.raises(ValueError, match=r"comera\.from_pretrained"):
        transformers.BertForMaskedLM.from_pretrained(plain, config=config)
    # a comera folder with another config object still finds no weights it can read
    with pytest.raises(OSError, match="model.safetensors"):
        transformers.BertForMaskedLM.from_pretrained(tmp_path, config=_config())


def test_a_sub_model_saves_a_comera_folder(tmp_path):
    tt = _converted()
    tt.bert.save_pretrained(tmp_path)
    assert "comera-model.safetensors" in os.listdir(tmp_path)
    assert "model.safetensors" not in os.listdir(tmp_path)
    with pytest.raises(ValueError, match=r"comera\.from_pretrained"):
        transformers.BertModel.from_pretrained(tmp_path)
    loaded = comera.from_pretrained(transformers.BertModel, tmp_path)
    assert type(loaded.embeddings.word_embeddings) is comera.TTEmbedding
    for k, v in tt.bert.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_plain_folder_holding_tt_cores_raises(tmp_path):
    tt = _converted()
    type(tt).save_pretrained(tt, tmp_path)          # the class's own save: no comera record
    assert "model.safetensors" in os.listdir(tmp_path)
    with pytest.raises(ValueError, match=r"holds TT weights for the Embedding"):
        transformers.BertForMaskedLM.from_pretrained(tmp_path)


def test_dense_weights_into_a_converted_class_raise_and_dense_loads_are_untouched(tmp_path):
    class Converted(transformers.BertForMaskedLM):
        def __init__(self, config):
            super().__init__(config)
            comera.convert(self, rank=4)

    dense = transformers.BertForMaskedLM(_config()).eval()
    dense.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dense weight for the TTEmbedding"):
        Converted.from_pretrained(tmp_path)
    again, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for k, v in dense.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_problems_match_names_with_and_without_the_base_prefix():
    head = transformers.BertForMaskedLM(_config())
    base = transformers.BertModel(_config())
    key = "embeddings.word_embeddings.cores.0"
    assert guard.problems(head, [key]) and guard.problems(head, ["bert." + key])
    assert guard.problems(base, [key]) and guard.problems(base, ["bert." + key])
    assert not guard.problems(base, ["cls.predictions.transform.dense.cores.0", "unrelated.cores.1"])
    assert not guard.problems(head, ["bert.embeddings.word_embeddings.weight"])


@pytest.mark.parametrize("order", ["comera first", "transformers first"])
def test_the_guard_is_active_whatever_the_import_order(order):
    imports = "import comera, transformers" if order == "comera first" else \
        "import transformers, comera"
    code = textwrap.dedent(f"""
        {imports}
        import sys, torch
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=16)
        tt = comera.TTEmbedding(50, 16, rank=2)
        state = {{"bert.embeddings.word_embeddings." + k: v for k, v in tt.state_dict().items()}}
        try:
            transformers.BertForMaskedLM.from_pretrained(None, config=cfg, state_dict=state)
        except ValueError as err:
            assert "comera.from_pretrained" in str(err)
        else:
            sys.exit("loaded")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300,
                   env={**os.environ, "PYTHONPATH": ROOT})
