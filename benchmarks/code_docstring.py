"""Code-docstring matching, a real-data classification task that ships with
the machine (in place of MNLI, which is not available offline).

Every function with a docstring in the Python standard library's sources and
the installed packages' sources gives a (docstring summary, function body)
pair.  Files are split into train / test by a hash of their path (no file
contributes to both), and within each split half of the examples keep their
own body (label 1) and half get the body of another function of the same
split (label 0).  Text is tokenised into lower-case words, identifier parts
(snake_case and camelCase split) and punctuation; the vocabulary is built
from the training split only.

Example:
    >>> tokens("def getItemCount(self): return len(self._items)")[:6]
    ['def', 'get', 'item', 'count', '(', 'self']
"""
import ast
import glob
import hashlib
import os
import random
import re
import sysconfig
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

PAD, UNK, CLS, SEP = 0, 1, 2, 3
# Part of the cache keys: bump it when the pairs change (2: the body starts with its signature).
FORMAT = 2
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
_WORD = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d_]")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def tokens(text: str) -> List[str]:
    """Lower-case word / identifier-part / punctuation tokens."""
    out = []
    for w in _WORD.findall(text):
        if w[0].isalpha():
            out.extend(p.lower() for p in _CAMEL.findall(w))
        else:
            out.append(w)
    return out


def source_roots() -> List[str]:
    """The standard library's source folder and the installed packages' one."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"]]
    return [r for i, r in enumerate(roots) if os.path.isdir(r) and r not in roots[:i]]


def _doc_summary(doc: str) -> str:
    """The docstring's first paragraph, on one line."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def functions_in_file(path: str, max_body_chars: int = 4000,
                      max_file_bytes: int = 400_000) -> List[Tuple[str, str]]:
    """(docstring summary, body source without the docstring) of each
    documented function in one file; unparsable or huge (generated) files
    give nothing."""
    try:
        if os.path.getsize(path) > max_file_bytes:
            return []
        with open(path, encoding="utf-8") as f:
            src = f.read()
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError, MemoryError):
        return []
    lines = src.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2:
            continue
        if node.body[0].lineno == node.lineno:  # docstring on the def line
            continue
        summary = _doc_summary(doc)
        # the code without its docstring, as in CodeSearchNet: the signature
        # (the def line(s), without decorators), then whole lines from the
        # first statement after the docstring to the end
        signature = lines[node.lineno - 1: node.body[0].lineno - 1]
        rest = lines[node.body[1].lineno - 1: node.end_lineno]
        body = textwrap.dedent("\n".join(signature + rest))
        if len(summary.split()) < 3 or len(body) < 40 or len(body) > max_body_chars:
            continue
        out.append((summary, body))
    return out


def _is_test(path: str) -> bool:
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % 5 == 0  # 20% of files


def _is_valid(path: str) -> bool:
    """About 1 in 8 of the training files (a second, independent hash), held
    out as the validation split that hyperparameters are chosen on."""
    return int(hashlib.sha1(("valid:" + path).encode()).hexdigest(), 16) % 8 == 0


def collect(roots: Sequence[str], max_files: int = 4000, seed: int = 0, valid: bool = False):
    """(train, test) lists of (doc, body) pairs from up to `max_files` .py
    files (a seeded sample, sorted paths first so the sample is stable);
    with `valid`, (train, valid, test): the validation pairs come from
    training-split files of their own (no file in two splits)."""
    files = sorted(p for r in roots for p in glob.glob(os.path.join(r, "**", "*.py"), recursive=True))
    rng = random.Random(seed)
    if len(files) > max_files:
        files = sorted(rng.sample(files, max_files))
    train, valid_f, test, seen = [], [], [], set()
    for path in files:
        rel = min((os.path.relpath(path, r) for r in roots if path.startswith(r)), key=len)
        split = test if _is_test(rel) else valid_f if valid and _is_valid(rel) else train
        for pair in functions_in_file(path):
            if pair in seen:
                continue
            seen.add(pair)
            split.append(pair)
    return (train, valid_f, test) if valid else (train, test)


def make_pairs(funcs: List[Tuple[str, str]], seed: int) -> List[Tuple[str, str, int]]:
    """Half of the functions keep their body (label 1), half get the body of
    another function of the same list (label 0; a rotation of the shuffled
    second half, so no body is reused and none is its own)."""
    rng = random.Random(seed)
    idx = list(range(len(funcs)))
    rng.shuffle(idx)
    half = len(idx) // 2
    pos, neg = idx[:half], idx[half:]
    out = [(funcs[i][0], funcs[i][1], 1) for i in pos]
    if len(neg) > 1:
        shift = rng.randrange(1, len(neg))
        out += [(funcs[i][0], funcs[neg[(k + shift) % len(neg)]][1], 0) for k, i in enumerate(neg)]
    rng.shuffle(out)
    return out


@dataclass
class Encoded:
    ids: torch.Tensor       # (N, seq) int64
    segments: torch.Tensor  # (N, seq) int64: 0 for [CLS] doc [SEP], 1 for the body
    padding: torch.Tensor   # (N, seq) bool: True at padding
    labels: torch.Tensor    # (N,) int64


class Vocab:
    """Most frequent training tokens; everything else is [UNK]."""

    def __init__(self, texts, size: int):
        counts = Counter(t for text in texts for t in tokens(text))
        self.itos = SPECIALS + [w for w, _ in counts.most_common(size - len(SPECIALS))]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self):
        return len(self.itos)

    def encode(self, text: str, limit: int) -> List[int]:
        return [self.stoi.get(t, UNK) for t in tokens(text)[:limit]]


def encode(pairs, vocab: Vocab, seq: int, doc_tokens: int) -> Encoded:
    """[CLS] doc [SEP] body, truncated / padded to `seq` tokens."""
    if seq < 4:
        raise ValueError(f"seq must be >= 4 ([CLS] doc [SEP] body), got {seq}")
    doc_tokens = max(1, min(doc_tokens, seq // 3))
    n = len(pairs)
    ids = torch.full((n, seq), PAD, dtype=torch.long)
    seg = torch.zeros((n, seq), dtype=torch.long)
    for i, (doc, body, _) in enumerate(pairs):
        d = vocab.encode(doc, doc_tokens)
        b = vocab.encode(body, seq - len(d) - 2)
        row = [CLS] + d + [SEP] + b
        ids[i, : len(row)] = torch.tensor(row)
        seg[i, len(d) + 2: len(row)] = 1
    labels = torch.tensor([p[2] for p in pairs], dtype=torch.long)
    return Encoded(ids, seg, ids == PAD, labels)


def split_pair(ids: torch.Tensor, segments: torch.Tensor, padding: torch.Tensor, doc_tokens: int):
    """The two sides of encoded [CLS] doc [SEP] body rows, for a dual
    encoder: (doc ids (N, doc_tokens), body ids (N, seq - 2)), each left-aligned
    and padded with PAD, without [CLS] and [SEP].

    Example:
        >>> ids = torch.tensor([[CLS, 7, 8, SEP, 9, 10, PAD]])
        >>> seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
        >>> d, b = split_pair(ids, seg, ids == PAD, doc_tokens=2)
        >>> d.tolist(), b.tolist()
        ([[7, 8]], [[9, 10, 0, 0, 0]])
    """
    n, seq = ids.shape
    special = (ids == CLS) | (ids == SEP) | padding
    sides = []
    for side, width in ((0, doc_tokens), (1, seq - 2)):
        keep = (segments == side) & ~special
        # stable left-alignment: kept positions first, in their order
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        out = torch.where(torch.gather(keep, 1, order), torch.gather(ids, 1, order),
                          torch.full_like(ids, PAD))
        sides.append(out[:, :width].contiguous())
    return sides[0], sides[1]


def load(vocab_size: int, seq: int, *, max_files: int = 4000, doc_tokens: int = 32,
         max_train: int = None, max_test: int = None, seed: int = 0, cache_dir: str = None,
         valid: bool = False):
    """Encoded (train, test) sets and the stats of the build; cached as a
    torch file keyed by the arguments (building parses a few thousand files).
    With `valid` a "valid" set too, from training-split files of its own
    (collect), capped at `max_test` pairs; the vocabulary comes from the
    training split alone either way."""
    key = hashlib.sha1(repr((FORMAT, source_roots(), vocab_size, seq, max_files, doc_tokens, max_train,
                             max_test, seed) + ((True,) if valid else ())).encode()).hexdigest()[:16]
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "comera-bench")
    path = os.path.join(cache_dir, f"code_docstring_{key}.pt")
    if os.path.exists(path):
        return torch.load(path)
    # the parsed functions are cached on their own: other encodings reuse them
    fkey = hashlib.sha1(repr((FORMAT, source_roots(), max_files, seed) + ((True,) if valid else ()))
                        .encode()).hexdigest()[:16]
    fpath = os.path.join(cache_dir, f"functions_{fkey}.pt")
    if os.path.exists(fpath):
        splits = torch.load(fpath)
    else:
        splits = collect(source_roots(), max_files=max_files, seed=seed, valid=valid)
        os.makedirs(cache_dir, exist_ok=True)
        torch.save(splits, fpath)
    train_f, test_f = splits[0], splits[-1]
    valid_f = splits[1] if valid else None
    rng = random.Random(seed)
    if max_train is not None and len(train_f) > max_train:
        train_f = rng.sample(train_f, max_train)
    if max_test is not None and len(test_f) > max_test:
        test_f = rng.sample(test_f, max_test)
    if valid and max_test is not None and len(valid_f) > max_test:
        valid_f = rng.sample(valid_f, max_test)
    if valid and len(valid_f) < 4:
        raise ValueError(f"max_files={max_files} gave {len(valid_f)} validation functions; expected "
                         "at least 4 (raise max_files)")
    if len(train_f) < 4 or len(test_f) < 4:
        raise ValueError(f"max_files={max_files} gave {len(train_f)} training and {len(test_f)} "
                         "test functions; expected at least 4 of each (raise max_files)")
    vocab = Vocab((t for d, b in train_f for t in (d, b)), vocab_size)
    train_p, test_p = make_pairs(train_f, seed), make_pairs(test_f, seed + 1)
    train, test = encode(train_p, vocab, seq, doc_tokens), encode(test_p, vocab, seq, doc_tokens)
    stats = {"train_pairs": len(train_p), "test_pairs": len(test_p), "vocab": len(vocab),
             "max_files": max_files, "seq": seq, "doc_tokens": doc_tokens,
             "train_positive_fraction": float(train.labels.float().mean()),
             "test_positive_fraction": float(test.labels.float().mean()),
             "unk_rate_test": float((test.ids == UNK).sum() / (~test.padding).sum())}
    out = {"train": train.__dict__, "test": test.__dict__, "stats": stats}
    if valid:
        valid_e = encode(make_pairs(valid_f, seed + 2), vocab, seq, doc_tokens)
        out["valid"] = valid_e.__dict__
        stats["valid_pairs"] = len(valid_f)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(out, path)
    return out
