"""generate() on converted causal language models (transformers' generation
tests are not in the shipped test files, see transformers_tests/README.md):
greedy search gives what the same weights give densified (comera.to_dense),
with and without the key/value cache, also after save_pretrained /
comera.from_pretrained; for BERT it also equals a greedy loop over the
model's logits (RoBERTa's generate numbers positions its own way, dense too)."""
import copy

import pytest
import torch

import comera

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hf_tiny import quiet, tiny_config  # noqa: E402

V = 90


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with quiet(transformers):
        yield


def _model(kind):
    torch.manual_seed(0)
    cfg = tiny_config(transformers, kind, vocab_size=V, is_decoder=True)
    model = (transformers.BertLMHeadModel if kind == "bert" else transformers.RobertaForCausalLM)(cfg)
    return comera.convert(model, rank=6).eval()


def _greedy(model, ids, steps):
    """The reference: argmax of the model's logits, the whole sequence each step."""
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_greedy_generate_matches_the_densified_model(tmp_path, kind):
    model = _model(kind)
    prompt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(7))
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = comera.to_dense(copy.deepcopy(model)).generate(prompt, **settings)
    if kind == "bert":
        assert torch.equal(_greedy(model, prompt, 8), expected)
    assert torch.equal(model.generate(prompt, use_cache=True, **settings), expected)
    assert torch.equal(model.generate(prompt, use_cache=False, **settings), expected)
    model.save_pretrained(tmp_path)
    cls = transformers.BertLMHeadModel if kind == "bert" else transformers.RobertaForCausalLM
    loaded = comera.from_pretrained(cls, tmp_path)
    assert torch.equal(loaded.generate(prompt, **settings), expected)
