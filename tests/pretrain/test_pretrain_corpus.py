"""comera pretrain corpora stored as records: JSON Lines (plain and gzip)
and Parquet, with CodeSearchNet-style fields; bad files are clear errors
naming the file and line or row, and leave no run directory behind."""
import gzip
import json
import os

import pytest

pytest.importorskip("transformers", reason="comera pretrain needs the train extra")
pytest.importorskip("tokenizers", reason="comera pretrain needs the train extra")

from comera.__main__ import main  # noqa: E402
from comera.pretrain import corpus as corpus_mod  # noqa: E402
from comera.pretrain import records  # noqa: E402

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq-len", "32",
        "--batch-size", "4", "--vocab-size", "300", "--valid-blocks", "2", "--eval-every", "2",
        "--checkpoint-every", "2", "--log-every", "1", "--valid-fraction", "0.25", "--quiet",
        "--threads", "1", "--method", "dense", "--steps", "2"]


def functions(n):
    """CodeSearchNet-like records: a function, its docstring and more."""
    out = []
    for i in range(n):
        doc = f"Return {i} added to x, then scaled by {i + 1}."
        code = f"def f{i}(x):\n    \"\"\"{doc}\"\"\"\n    y = x + {i}\n    return y * {i + 1}\n"
        out.append({"repo": f"org/repo{i % 3}", "path": f"pkg/mod{i}.py", "func_name": f"f{i}",
                    "original_string": code, "code": code, "docstring": doc, "language": "python"})
    return out


def write_jsonl(path, rows, compress=False, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    data = ("\n".join(lines) + "\n").encode("utf-8")
    with (gzip.open if compress else open)(path, "wb") as fh:
        fh.write(data)
    return str(path)


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=7)
    return str(path)


def docs(c):
    return dict(c.train + c.valid)


def test_jsonl_gz_and_parquet_give_the_same_documents(tmp_path):
    rows = functions(30)
    rows[4]["code"] = "   \n"  # a blank record is skipped and counted
    a = corpus_mod.load_corpus(write_jsonl(tmp_path / "f.jsonl", rows), text_fields=["code"])
    b = corpus_mod.load_corpus(write_jsonl(tmp_path / "f.jsonl.gz", rows, compress=True),
                               text_fields=["code"])
    c = corpus_mod.load_corpus(write_parquet(tmp_path / "f.parquet", rows), text_fields=["code"])
    expected = {i: r["code"] for i, r in enumerate(rows) if i != 4}
    # JSON Lines names records by line (from 1), Parquet by row (from 0).
    assert docs(a) == {f"f.jsonl:{i + 1}": t for i, t in expected.items()}
    assert docs(b) == {f"f.jsonl.gz:{i + 1}": t for i, t in expected.items()}
    assert docs(c) == {f"f.parquet:{i}": t for i, t in expected.items()}
    for x in (a, b, c):
        assert x.skipped == {"empty": 1} and len(x.valid) == 2  # ceil(0.05 * 29)
    # Two fields make one document, in the order given.
    d = corpus_mod.load_corpus(str(tmp_path / "f.parquet"), text_fields=["docstring", "code"])
    assert docs(d)["f.parquet:7"] == rows[7]["docstring"] + "\n" + rows[7]["code"]
    # A glob over several record files, with a seeded subset of the records.
    e = corpus_mod.load_corpus(str(tmp_path / "f.*"), text_fields=["code"], max_files=10)
    assert len(docs(e)) == 10 and set(docs(e).values()) <= set(expected.values())
    assert e.root == str(tmp_path)


def test_blank_lines_are_ignored_and_line_numbers_count_them(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"text": "a = 1"}\n\n   \n{"text": "b = 2"}\n')
    assert list(records.read_jsonl(str(path), ["text"])) == [(1, "a = 1"), (4, "b = 2")]


@pytest.mark.parametrize("kind", ["bad_json", "missing_field", "not_string", "null", "not_object",
                                  "not_utf8", "bad_gzip", "parquet_missing", "parquet_type",
                                  "parquet_null", "not_parquet", "all_blank"])
def test_bad_record_files_are_clear_errors(tmp_path, kind, capsys):
    rows = functions(6)
    field = "code"
    if kind == "bad_json":
        spec = write_jsonl(tmp_path / "c.jsonl", rows, raw_lines=['{"code": "x" oops}'])
        expect = r"c\.jsonl: line 7: not valid JSON"
    elif kind == "missing_field":
        rows[2].pop("code")
        spec, expect = write_jsonl(tmp_path / "c.jsonl", rows), r"c\.jsonl: line 3: no field 'code'"
    elif kind == "not_string":
        rows[4]["code"] = ["def f(): pass"]
        spec, expect = write_jsonl(tmp_path / "c.jsonl", rows), r"line 5: field 'code' is list, expected a string"
    elif kind == "null":
        rows[0]["docstring"] = None
        spec, field = write_jsonl(tmp_path / "c.jsonl.gz", rows, compress=True), "docstring"
        expect = r"c\.jsonl\.gz: line 1: field 'docstring' is null"
    elif kind == "not_object":
        spec = write_jsonl(tmp_path / "c.jsonl", rows, raw_lines=['["code"]'])
        expect = r"line 7: expected a JSON object, got list"
    elif kind == "not_utf8":
        spec = str(tmp_path / "c.jsonl")
        with open(spec, "wb") as fh:
            fh.write(b'{"code": "ok"}\n{"code": "caf\xe9"}\n')
        expect = r"c\.jsonl: line 2: not UTF-8"
    elif kind == "bad_gzip":
        spec = str(tmp_path / "c.jsonl.gz")
        with open(spec, "wb") as fh:
            fh.write(b"this is not gzip data\n")
        expect = r"c\.jsonl\.gz: cannot be read"
    elif kind == "parquet_missing":
        spec, field = write_parquet(tmp_path / "c.parquet", rows), "text"
        expect = r"c\.parquet: no column 'text'.*code"
    elif kind == "parquet_type":
        for i, r in enumerate(rows):
            r["code"] = i
        spec, expect = write_parquet(tmp_path / "c.parquet", rows), r"column 'code' holds int64, expected strings"
    elif kind == "parquet_null":
        rows[3]["code"] = None
        spec, expect = write_parquet(tmp_path / "c.parquet", rows), r"c\.parquet: row 3: field 'code' is null"
    elif kind == "not_parquet":
        spec = str(tmp_path / "c.parquet")
        with open(spec, "w") as fh:
            fh.write("code\nx = 1\n")
        expect = r"c\.parquet: not a readable Parquet file"
    else:
        for r in rows:
            r["code"] = ""
        spec, expect = write_jsonl(tmp_path / "c.jsonl", rows), "could be read as UTF-8 text or held a record"
    with pytest.raises(ValueError, match=expect):
        corpus_mod.load_corpus(spec, text_fields=[field])
    out = tmp_path / "run"
    assert main(["pretrain", "--corpus", spec, "--text-field", field, "--out", str(out), *TINY]) == 2
    assert "comera pretrain: error:" in capsys.readouterr().err
    assert not out.exists()  # the corpus is checked before the run directory is made


def test_pretrain_on_a_jsonl_gz_corpus_with_two_fields(tmp_path):
    spec = write_jsonl(tmp_path / "train_0.jsonl.gz", functions(40), compress=True)
    out = str(tmp_path / "run")
    args = ["--corpus", spec, "--text-field", "docstring", "code", "--out", out, *TINY]
    assert main(["pretrain", *args]) == 0
    with open(os.path.join(out, "metrics.json")) as fh:
        m = json.load(fh)
    assert m["config"]["text_fields"] == ["docstring", "code"]
    assert m["corpus"]["train_files"] + m["corpus"]["valid_files"] == 40
    assert m["methods"]["dense"]["steps_done"] == 2
    # The fields are part of the run: resuming with others is refused.
    assert main(["pretrain", *args[:2], "--text-field", "code", *args[5:], "--resume"]) == 2
    assert main(["pretrain", *args, "--resume"]) == 0
