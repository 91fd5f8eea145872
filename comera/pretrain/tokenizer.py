"""Byte-level BPE tokenizer trained on the training split, cached in the run
directory together with the token ids it produced.

Special tokens follow RoBERTa: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2,
``<unk>`` 3, ``<mask>`` 4.
"""
import hashlib
import json
import os
from typing import List, Sequence, Tuple

import torch

from comera.storage import atomic_write, write_json

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
BOS, PAD, EOS, UNK, MASK = range(5)


def _require_tokenizers():
    try:
        import tokenizers  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("comera pretrain needs the 'train' extra: pip install 'comera[train]'") from e


def fingerprint(texts: Sequence[Tuple[str, str]], *extra) -> str:
    """A hash of the (path, text) pairs and any extra settings: the cache key."""
    h = hashlib.sha256()
    for item in extra:
        h.update(repr(item).encode("utf-8"))
    for path, text in texts:
        h.update(path.encode("utf-8"))
        h.update(b"\0")
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    return h.hexdigest()


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8192, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``.

    Example:
        >>> tok = train_tokenizer(["def f(x):\\n    return x\\n"] * 20, vocab_size=300)
        >>> tok.token_to_id("<mask>"), tok.decode(tok.encode("return x").ids)
        (4, 'return x')
    """
    _require_tokenizers()
    from tokenizers import ByteLevelBPETokenizer
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 300:
        # 256 byte symbols + 5 special tokens must fit, with room for merges.
        raise ValueError(f"vocab_size must be an int >= 300, got {vocab_size!r}")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok = bpe._tokenizer
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, "special token ids must follow RoBERTa's"
    return tok


def encode_files(tok, texts: Sequence[str], max_tokens: int = None) -> torch.Tensor:
    """Token ids of the texts, each file followed by ``</s>``, as one int32
    stream.  Stops after the file that reaches ``max_tokens`` (if given)."""
    out: List[torch.Tensor] = []
    total, chunk = 0, 64
    for start in range(0, len(texts), chunk):
        for enc in tok.encode_batch(list(texts[start:start + chunk])):
            ids = enc.ids + [EOS]
            out.append(torch.tensor(ids, dtype=torch.int32))
            total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int32)


def load_or_build(run_dir: str, corpus, *, vocab_size: int, max_train_tokens: int = None,
                  max_valid_tokens: int = None, tokenizer_max_bytes: int = None, resume: bool = False,
                  log=print):
    """The tokenizer and the (train, valid) token streams for ``corpus``,
    from the cache in ``run_dir`` when it was built from the same files and
    settings, else trained, encoded and cached there.  With ``resume`` a
    cache built from other files is an error (the checkpoints depend on it).

    Returns ``(tokenizer, train_ids, valid_ids, info)``.
    """
    _require_tokenizers()
    from tokenizers import Tokenizer
    key = fingerprint(corpus.train + corpus.valid, vocab_size, max_train_tokens, max_valid_tokens,
                      tokenizer_max_bytes)
    tok_path = os.path.join(run_dir, "tokenizer.json")
    meta_path = os.path.join(run_dir, "tokenizer_meta.json")
    ids_path = os.path.join(run_dir, "tokens.pt")
    if all(os.path.exists(p) for p in (tok_path, meta_path, ids_path)):
        with open(meta_path) as fh:
            meta = json.load(fh)
        if meta.get("fingerprint") == key:
            ids = torch.load(ids_path, weights_only=True)
            log(f"tokenizer: cached ({meta['vocab_size']} tokens) in {tok_path}")
            return Tokenizer.from_file(tok_path), ids["train"], ids["valid"], meta
        if resume:
            raise ValueError(f"--resume: the corpus changed since this run tokenized it (the files "
                             f"or their contents differ from those behind {tok_path})")
    train_texts = [t for _, t in corpus.train]
    tok_texts, used = train_texts, 0
    if tokenizer_max_bytes is not None:
        # A deterministic prefix of the (fixed-order) training files is plenty
        # for the merges of a small vocabulary, and much faster to count.
        tok_texts = []
        for t in train_texts:
            if used >= tokenizer_max_bytes:
                break
            tok_texts.append(t)
            used += len(t.encode("utf-8"))
    log(f"tokenizer: training byte-level BPE (vocab {vocab_size}) on {len(tok_texts)} files")
    tok = train_tokenizer(tok_texts, vocab_size)
    log("tokenizer: encoding the corpus")
    train_ids = encode_files(tok, train_texts, max_train_tokens)
    valid_ids = encode_files(tok, [t for _, t in corpus.valid], max_valid_tokens)
    meta = {"fingerprint": key, "vocab_size": tok.get_vocab_size(), "requested_vocab_size": vocab_size,
            "tokenizer_files": len(tok_texts), "train_tokens": int(train_ids.numel()),
            "valid_tokens": int(valid_ids.numel())}
    os.makedirs(run_dir, exist_ok=True)
    atomic_write(tok_path, tok.save)
    atomic_write(ids_path, lambda tmp: torch.save({"train": train_ids, "valid": valid_ids}, tmp))
    write_json(meta_path, meta)
    return tok, train_ids, valid_ids, meta
