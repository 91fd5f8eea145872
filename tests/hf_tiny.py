"""Shared pieces of the Hugging Face tests: a tiny BERT/RoBERTa configuration
and transformers' logging kept quiet for a test.

Example:
    >>> import pytest
    >>> transformers = pytest.importorskip("transformers")
    >>> tiny_config(transformers, "roberta", vocab_size=50).pad_token_id
    1
"""
import contextlib

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def tiny_config(transformers, kind: str = "bert", **kw):
    """A BertConfig (``kind="bert"``) or RobertaConfig (pad token 1) with the
    TINY sizes, no dropout, overridden by ``kw`` (``vocab_size`` among them)."""
    args = dict(TINY, **kw)
    if kind == "bert":
        return transformers.BertConfig(**args)
    if kind == "roberta":
        return transformers.RobertaConfig(pad_token_id=1, **args)
    raise ValueError(f"kind must be 'bert' or 'roberta', got {kind!r}")


@contextlib.contextmanager
def quiet(transformers):
    """transformers' logging at error level inside the block (load reports of
    plain loads are expected noise in these tests)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
