"""Corpora stored as records: JSON Lines (``.jsonl``, ``.jsonl.gz``) and
Parquet (``.parquet``, read with pyarrow), one document per record, its text
taken from one or more string fields (CodeSearchNet: ``code``,
``original_string``, ``docstring``).

Every record is checked: a line that is not JSON, a record without a
requested field or with a field that is not a string is an error naming the
file and the line (JSON Lines, counted from 1) or row (Parquet, counted from
0); blank lines are ignored, records whose text is blank are skipped and
counted.
"""
import gzip
import json
import zlib
from typing import Iterator, Optional, Sequence, Tuple

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


class RecordError(ValueError):
    """A record file that cannot be read as asked."""


def is_record_file(path: str) -> bool:
    """True for the file names read record by record.

    Example:
        >>> is_record_file("train_0.jsonl.gz"), is_record_file("a.PARQUET"), is_record_file("a.py")
        (True, True, False)
    """
    return path.lower().endswith(RECORD_SUFFIXES)


def _check_fields(fields: Sequence[str]) -> Tuple[str, ...]:
    if isinstance(fields, str) or not fields or not all(isinstance(f, str) and f for f in fields):
        raise ValueError(f"--text-field must be one or more field names, got {fields!r}")
    return tuple(fields)


def _text(record, fields, where: str) -> str:
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    parts = []
    for f in fields:
        if f not in record:
            shown = ", ".join(sorted(record)[:12]) or "none"
            raise RecordError(f"{where}: no field {f!r} (--text-field); the record's fields: {shown}")
        value = record[f]
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            raise RecordError(f"{where}: field {f!r} is {kind}, expected a string")
        parts.append(value)
    return "\n".join(parts)


def read_jsonl(path: str, fields: Sequence[str]) -> Iterator[Tuple[int, str]]:
    """``(line number, text)`` of every record of a JSON Lines file (gzip
    compressed when the name ends in ``.gz``).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f.jsonl")
        >>> _ = open(path, "w").write('{"code": "x = 1", "docstring": "One."}\\n\\n{"code": "y = 2", "docstring": ""}\\n')
        >>> list(read_jsonl(path, ["docstring", "code"]))
        [(1, 'One.\\nx = 1'), (3, '\\ny = 2')]
    """
    fields = _check_fields(fields)
    name = path
    opener = gzip.open if path.lower().endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                where = f"{name}: line {lineno}"
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise RecordError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
                except json.JSONDecodeError as e:
                    raise RecordError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                yield lineno, _text(record, fields, where)
    except (OSError, EOFError, zlib.error) as e:
        # gzip.BadGzipFile is an OSError; a truncated stream an EOFError.
        after = f" after line {lineno}" if lineno else ""
        raise RecordError(f"{name}: cannot be read{after} ({type(e).__name__}: {e})") from None


def _require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("a .parquet --corpus needs pyarrow (in the 'train' extra: "
                          "pip install 'comera[train]')") from e
    return pq


def read_parquet(path: str, fields: Sequence[str], batch_rows: int = 4096) -> Iterator[Tuple[int, str]]:
    """``(row index, text)`` of every row of a Parquet file, read in batches.

    Example:
        >>> import os, tempfile, pyarrow, pyarrow.parquet
        >>> path = os.path.join(tempfile.mkdtemp(), "f.parquet")
        >>> pyarrow.parquet.write_table(pyarrow.table({"code": ["a = 1", "b = 2"], "n": [1, 2]}), path)
        >>> list(read_parquet(path, ["code"]))
        [(0, 'a = 1'), (1, 'b = 2')]
    """
    fields = _check_fields(fields)
    name = path
    pq = _require_pyarrow()
    import pyarrow as pa
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise RecordError(f"{name}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    for f in fields:
        if f not in schema.names:
            raise RecordError(f"{name}: no column {f!r} (--text-field); its columns: "
                              f"{', '.join(schema.names[:12]) or 'none'}")
        kind = schema.field(f).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise RecordError(f"{name}: column {f!r} holds {kind}, expected strings")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=list(dict.fromkeys(fields))):
            columns = [batch.column(f).to_pylist() for f in fields]
            for values in zip(*columns):
                for f, v in zip(fields, values):
                    if v is None:
                        raise RecordError(f"{name}: row {row}: field {f!r} is null, expected a string")
                yield row, "\n".join(values)
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise RecordError(f"{name}: cannot be read at row {row} ({e})") from None


def read_records(path: str, fields: Sequence[str], name: Optional[str] = None) -> Iterator[Tuple[str, str]]:
    """``(document name, text)`` of every record of ``path``: the name is
    ``name:line`` for JSON Lines, ``name:row`` for Parquet (``name``
    defaults to ``path``; errors name ``path``)."""
    name = name or path
    reader = read_parquet if path.lower().endswith(".parquet") else read_jsonl
    for pos, text in reader(path, fields):
        yield f"{name}:{pos}", text
