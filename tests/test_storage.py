"""comera.save / comera.load (safetensors with TT ranks in the metadata) and
plain torch.save / torch.load(weights_only=True) of a converted model."""
import json

import pytest
import torch
from torch import nn

import comera

safetensors = pytest.importorskip("safetensors")


def mlp(seed, rank=6):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    return comera.convert(net, rank=rank)


def test_roundtrip_reproduces_the_model(tmp_path):
    net = mlp(0)
    path = tmp_path / "net.safetensors"
    comera.save(net, path)
    fresh = mlp(1)
    x = torch.randn(5, 64)
    assert not torch.allclose(fresh(x), net(x))
    out = comera.load(fresh, path)
    assert out is fresh
    torch.testing.assert_close(fresh(x), net(x), atol=0, rtol=0)


def test_file_is_plain_safetensors_with_ranks_in_the_metadata(tmp_path):
    net = mlp(0)
    with torch.no_grad():
        net[2].gates[1][:3] = 0.0                          # three dead ranks on bond 1
    path = tmp_path / "net.safetensors"
    comera.save(net, path, metadata={"step": "100"})
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        core = f.get_tensor("0.cores.1")
    assert keys == set(net.state_dict())
    torch.testing.assert_close(core, net[0].cores[1].detach())
    layers = json.loads(meta["comera.layers"])
    assert layers["0"]["ranks"] == net[0].ranks and layers["2"]["ranks"] == net[2].ranks
    live = list(net[2].ranks)
    live[1] -= 3
    assert layers["2"]["live_ranks"] == live
    assert layers["2"]["modes"] == [list(c.shape[1:-1]) for c in net[2].cores]
    assert meta["step"] == "100"
    assert comera.storage.read_metadata(path)["user"] == {"format": "pt", "step": "100"}


def test_load_takes_the_checkpoint_ranks(tmp_path):
    small = mlp(0, rank=2)                 # e.g. a model pruned before saving
    path = tmp_path / "small.safetensors"
    comera.save(small, path)
    big = mlp(1, rank=8)
    core_objects = [id(p) for p in big.parameters()]
    comera.load(big, path)
    assert big[0].ranks == small[0].ranks and big[2].ranks == small[2].ranks
    assert [id(p) for p in big.parameters()] == core_objects      # the same Parameter objects
    x = torch.randn(3, 64)
    torch.testing.assert_close(big(x), small(x), atol=0, rtol=0)
    # and it trains afterwards (with an optimizer built after loading)
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    big(x).sum().backward()
    opt.step()


def test_torch_save_state_dict_loads_with_weights_only(tmp_path):
    net = mlp(0, rank=3)
    path = tmp_path / "net.pt"
    torch.save(net.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    fresh = mlp(1, rank=3)
    fresh.load_state_dict(sd)
    x = torch.randn(2, 64)
    torch.testing.assert_close(fresh(x), net(x), atol=0, rtol=0)
    # comera.load reads such files too, and adapts the ranks
    other = mlp(2, rank=7)
    comera.load(other, path)
    torch.testing.assert_close(other(x), net(x), atol=0, rtol=0)


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path):
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    b.weight = a.weight
    net = nn.Sequential(a, nn.Tanh(), b, nn.Linear(64, 64))
    comera.convert(net, rank=4, include="3")
    path = tmp_path / "tied.safetensors"
    comera.save(net, path)
    meta = comera.storage.read_metadata(path)
    assert meta["aliases"] == {"2.weight": "0.weight"}
    torch.manual_seed(5)
    a2, b2 = nn.Linear(64, 64), nn.Linear(64, 64)
    b2.weight = a2.weight
    fresh = comera.convert(nn.Sequential(a2, nn.Tanh(), b2, nn.Linear(64, 64)), rank=4, include="3")
    comera.load(fresh, path)
    assert fresh[0].weight is fresh[2].weight
    torch.testing.assert_close(fresh[2].weight, net[2].weight, atol=0, rtol=0)


def test_float64_and_device_are_kept(tmp_path):
    net = comera.convert(nn.Sequential(nn.Linear(32, 32)).double(), rank=3)
    path = tmp_path / "d.safetensors"
    comera.save(net, path)
    fresh = comera.convert(nn.Sequential(nn.Linear(32, 32)).double(), rank=5)
    comera.load(fresh, path)
    assert fresh[0].cores[0].dtype == torch.float64
    torch.testing.assert_close(fresh[0].weight, net[0].weight, atol=0, rtol=0)


def test_loading_tt_checkpoint_into_a_dense_model_names_the_layer(tmp_path):
    path = tmp_path / "net.safetensors"
    comera.save(mlp(0), path)
    dense = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    with pytest.raises(ValueError, match=r"'0'.*convert the model first"):
        comera.load(dense, path)


def test_loading_other_mode_sizes_names_the_layer(tmp_path):
    path = tmp_path / "l.safetensors"
    comera.save(nn.Sequential(comera.TTLinear(64, 64, rank=4, in_shape=[4, 16])), path)
    other = nn.Sequential(comera.TTLinear(64, 64, rank=4, in_shape=[8, 8]))
    with pytest.raises(ValueError, match=r"'0'.*only the rank dims"):
        comera.load(other, path)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="model"):
        comera.save("net", tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="reserved"):
        comera.save(mlp(0), tmp_path / "x.safetensors", metadata={"comera.layers": "{}"})
    with pytest.raises(TypeError, match="metadata"):
        comera.save(mlp(0), tmp_path / "x.safetensors", metadata={"step": 3})
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        comera.load(mlp(0), tmp_path / "missing.safetensors")


def test_strict_reports_missing_keys(tmp_path):
    path = tmp_path / "a.safetensors"
    comera.save(mlp(0), path)
    bigger = nn.Sequential(*mlp(1), nn.Linear(32, 2))
    with pytest.raises(RuntimeError, match="Missing key"):
        comera.load(bigger, path)
    comera.load(bigger, path, strict=False)
    torch.testing.assert_close(bigger[0].weight, comera.load(mlp(3), path)[0].weight)


def test_converted_bert_roundtrip_keeps_the_tie(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=32)

    def build(seed):
        torch.manual_seed(seed)
        return comera.convert(transformers.BertForMaskedLM(cfg), rank=8).eval()

    model = build(0)
    path = tmp_path / "bert.safetensors"
    comera.save(model, path)
    fresh = comera.load(build(1), path)
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    head, word = fresh.cls.predictions, fresh.bert.embeddings.word_embeddings
    if isinstance(word, nn.Embedding):           # dense embedding: the decoder stays tied to it
        assert head.decoder.weight is word.weight
    else:                                        # TT embedding: the decoder reads its table
        assert head.decoder.embedding is word
    assert head.decoder.bias is head.bias
