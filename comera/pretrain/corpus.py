"""The pre-training corpus: source files found on disk, decoded as UTF-8 and
split into training and validation sets by file; or records of JSON Lines
and Parquet files (:mod:`comera.pretrain.records`), split by record.

By default the corpus is the ``.py`` files of the running interpreter's
standard library: real code that ships with every Python.  The split is
decided per file from a hash of its path relative to the corpus root, so it
does not depend on the order the file system lists files in, and a file
never has lines in both sets.
"""
import glob
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from comera.pretrain.records import is_record_file, read_records

# The record field read when --text-field is not given.
DEFAULT_TEXT_FIELDS = ("text",)


class CorpusError(ValueError):
    """The corpus argument names nothing usable (missing, empty, unreadable)."""


@dataclass
class Corpus:
    """Decoded source files, split by file.

    ``train`` and ``valid`` are lists of ``(relative path, text)`` pairs, in
    a fixed, seeded order that mixes folders.  ``skipped`` counts files that
    could not be read or did not decode as UTF-8 (by reason), and
    ``skipped_files`` names them.
    """
    root: str
    train: List[Tuple[str, str]]
    valid: List[Tuple[str, str]]
    skipped: dict = field(default_factory=dict)
    skipped_files: List[str] = field(default_factory=list)

    def describe(self) -> dict:
        """A JSON-ready summary for the report."""
        return {
            "root": self.root,
            "train_files": len(self.train),
            "valid_files": len(self.valid),
            "train_bytes": sum(len(t.encode("utf-8")) for _, t in self.train),
            "valid_bytes": sum(len(t.encode("utf-8")) for _, t in self.valid),
            "skipped": dict(self.skipped),
            "skipped_examples": self.skipped_files[:10],
        }


def default_corpus_root() -> str:
    """The directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


# Third-party packages can live inside the stdlib tree (a system Python's
# site-packages); they are not the standard library.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def find_source_files(spec: Optional[str] = None, extensions: Sequence[str] = (".py",)) -> Tuple[str, List[str]]:
    """Returns ``(root, files)``: every source file named by ``spec``, sorted.

    ``spec`` is a folder (searched recursively for ``extensions``), a single
    file, or a glob pattern (``**`` recurses; every matching file is taken,
    whatever its extension).  ``None`` means the standard library.

    Raises :class:`CorpusError` (a ValueError) when ``spec`` names nothing or
    no file matches.

    Example:
        >>> root, files = find_source_files()
        >>> any(f.endswith("json/__init__.py") for f in files)
        True
    """
    if spec is None:
        spec = default_corpus_root()
    if not isinstance(spec, str) or not spec.strip():
        raise CorpusError(f"--corpus must be a folder, a file or a glob pattern, got {spec!r}")
    exts = tuple(e if e.startswith(".") else "." + e for e in extensions)
    if os.path.isdir(spec):
        root = os.path.abspath(spec)
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
            files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(exts))
        if not files:
            raise CorpusError(f"--corpus folder {spec!r} contains no source files "
                              f"(expected files ending in {', '.join(exts)})")
    elif os.path.isfile(spec):
        root = os.path.dirname(os.path.abspath(spec))
        files = [os.path.abspath(spec)]
    elif glob.has_magic(spec):
        files = [os.path.abspath(f) for f in glob.glob(spec, recursive=True) if os.path.isfile(f)]
        if not files:
            raise CorpusError(f"--corpus pattern {spec!r} matches no files")
        root = os.path.commonpath([os.path.dirname(f) for f in files])
    else:
        raise CorpusError(f"--corpus {spec!r} does not exist (expected a folder, a file or a "
                          "glob pattern such as 'src/**/*.py')")
    return root, sorted(files)


def _split_key(rel_path: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{rel_path}".encode("utf-8")).hexdigest()


def split_files(rel_paths: Sequence[str], valid_fraction: float, seed: int = 0) -> Tuple[List[str], List[str]]:
    """Deterministic split of ``rel_paths`` into (train, valid) by file.

    Files are ranked by a hash of ``seed`` and their path; the first
    ``ceil(valid_fraction * n)`` (at least one) go to validation.  Both
    returned lists are sorted.

    Example:
        >>> train, valid = split_files(["a.py", "b.py", "c.py", "d.py"], 0.25)
        >>> len(train), len(valid), sorted(train + valid)
        (3, 1, ['a.py', 'b.py', 'c.py', 'd.py'])
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    paths = sorted(set(rel_paths))
    if len(paths) < 2:
        raise CorpusError(f"the corpus needs at least 2 readable files or records to split into "
                          f"training and validation by document, got {len(paths)}")
    n_valid = min(len(paths) - 1, max(1, math.ceil(valid_fraction * len(paths))))
    ranked = sorted(paths, key=lambda p: _split_key(p, seed))
    valid = set(ranked[:n_valid])
    return [p for p in paths if p not in valid], [p for p in paths if p in valid]


def _read_text(path: str) -> Tuple[Optional[str], Optional[str]]:
    """(text, None) or (None, reason)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None, "unreadable"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    if "\x00" in text:
        return None, "binary"
    if not text.strip():
        return None, "empty"
    return text, None


def _read_documents(rels: dict, text_fields: Sequence[str]):
    """Decodes every file of ``{relative path: path}``: a record file gives
    one document per record (named ``path:line`` or ``path:row``), any
    other file one document.  Returns (texts, skipped counts, skipped names)."""
    texts, skipped, skipped_files = {}, {}, []

    def skip(reason, name):
        skipped[reason] = skipped.get(reason, 0) + 1
        skipped_files.append(name)

    for rel in sorted(rels):
        if is_record_file(rel):
            for name, text in read_records(rels[rel], text_fields, rel):
                if text.strip():
                    texts[name] = text
                else:
                    skip("empty", name)
            continue
        text, reason = _read_text(rels[rel])
        if text is None:
            skip(reason, rel)
        else:
            texts[rel] = text
    return texts, skipped, skipped_files


def _subset(names, n: int, seed: int):
    return sorted(names, key=lambda p: _split_key(p, seed + 1))[:n]


def load_corpus(spec: Optional[str] = None, *, valid_fraction: float = 0.05, seed: int = 0,
                max_files: Optional[int] = None, extensions: Sequence[str] = (".py",),
                text_fields: Sequence[str] = DEFAULT_TEXT_FIELDS) -> Corpus:
    """Finds, decodes and splits the corpus.

    Files that cannot be read or decoded are skipped and counted, never
    fatal; a ``.jsonl``, ``.jsonl.gz`` or ``.parquet`` file gives one
    document per record (its ``text_fields``, see
    :mod:`comera.pretrain.records`) and a bad record is an error naming the
    file and line or row.  ``max_files`` keeps a deterministic subset of the
    documents (the ones ranked first by a seeded hash of their name), for
    quick runs.

    Example:
        >>> c = load_corpus(max_files=20)
        >>> len(c.train) + len(c.valid)
        20
    """
    root, files = find_source_files(spec, extensions)
    rels = {os.path.relpath(f, root): f for f in files}
    if max_files is not None:
        if isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 2:
            raise ValueError(f"max_files must be an int >= 2, got {max_files!r}")
        # Files first (cheap, before reading); a record file counts as one.
        rels = {p: rels[p] for p in _subset(rels, max_files, seed)}
    texts, skipped, skipped_files = _read_documents(rels, text_fields)
    if max_files is not None and len(texts) > max_files:
        texts = {p: texts[p] for p in _subset(texts, max_files, seed)}
    if not texts:
        raise CorpusError(f"--corpus {spec if spec is not None else root!r}: none of its "
                          f"{len(rels)} files could be read as UTF-8 text or held a record with "
                          f"non-blank text (skipped: {skipped})")
    train, valid = split_files(list(texts), valid_fraction, seed)
    # Documents are kept in a seeded hash order rather than sorted by name,
    # so any prefix (tokenizer sample, a token budget) mixes all packages.
    order = lambda p: _split_key(p, seed + 2)  # noqa: E731
    return Corpus(root=root, train=[(p, texts[p]) for p in sorted(train, key=order)],
                  valid=[(p, texts[p]) for p in sorted(valid, key=order)], skipped=skipped,
                  skipped_files=skipped_files)
