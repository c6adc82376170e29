"""Each bad input fails with one line naming the file, the line or row, and the fix; and no
manifest. --skip-bad-records counts bad records instead."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from tests.data.conftest import write_jsonl, write_parquet
from tests.tmpfs import small_tmpfs

GOOD = b'{"text": "a good record"}\n'


def lines(*records: bytes) -> bytes:
    return GOOD + b"".join(records)


CASES = {
    "malformed JSON": ("bad.jsonl", lines(b'{"text": oops}\n'), ":2: not JSON"),
    "missing field": ("bad.jsonl", lines(b"\n", b'{"body": "x"}\n'), ":3: no 'text' field"),
    "not a string": ("bad.jsonl", lines(b'{"text": 5}\n'), ":2: 'text' is a number"),
    "not an object": ("bad.jsonl", lines(b'["text"]\n'), ":2: a JSON array"),
    "JSONL not UTF-8": ("bad.jsonl", lines(b'{"text": "caf\xe9"}\n'), ":2: not UTF-8"),
    "gzip not UTF-8": ("bad.jsonl.gz", lines(b'{"text": "\xff"}\n'), ":2: not UTF-8"),
    "txt not UTF-8": ("bad.txt", b"caf\xe9\n", ": not UTF-8"),
    "empty file": ("bad.jsonl", b"\n", " holds no documents"),
    "unknown extension": ("bad.csv", b"text\nhello\n", ": unknown input format .csv"),
    "not gzip": ("bad.jsonl.gz", GOOD, ": not a readable gzip file"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_names_file_and_line(tmp_path, prepare, case):
    name, data, message = CASES[case]
    path = tmp_path / name
    if case.startswith("gzip"):
        data = gzip.compress(data)
    path.write_bytes(data)
    r = prepare([path], tmp_path / "out")
    assert r.rc == 1 and f"meshkeeper: {path}{message}" in r.err, r.err
    assert (
        len(r.err.strip().splitlines()) == 1 and not (tmp_path / "out" / "manifest.json").exists()
    )


@pytest.mark.parametrize(
    "rows, where",
    [
        ({"body": ["a", "b"]}, ": no column 'text' (it has 'body'); name the text column"),
        ({"text": [1, 2]}, ": column 'text' holds int64, not strings"),
        ({"text": ["a", "b", None]}, ", row 2: 'text' is null"),
    ],
)
def test_bad_parquet_names_file_and_row(tmp_path, prepare, rows, where):
    ((field, values),) = rows.items()
    path = write_parquet(tmp_path / "bad.parquet", values, field=field)
    r = prepare([path], tmp_path / "out")
    assert r.rc == 1 and f"meshkeeper: {path}{where}" in r.err, r.err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_missing_input_and_a_foreign_directory(tmp_path, prepare, docs):
    data = write_jsonl(tmp_path / "a.jsonl", docs[:5])
    r = prepare([tmp_path / "nope.jsonl"], tmp_path / "out")
    assert r.rc == 1 and "nope.jsonl does not exist" in r.err
    r = prepare([tmp_path / "*.parquet"], tmp_path / "out")
    assert r.rc == 1 and "matches no file" in r.err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    r = prepare([data], mine)
    assert r.rc == 1 and "holds notes.txt" in r.err and "refusing" in r.err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_skip_bad_records_counts_them(tmp_path, prepare, docs):
    jsonl = tmp_path / "a.jsonl"
    good = [json.dumps({"text": t}).encode() + b"\n" for t in docs[:5]]
    jsonl.write_bytes(b"".join(good) + b'{"text": 1}\n{oops\n{"body": "x"}\n{"text": "\xe9"}\n')
    table = write_parquet(tmp_path / "b.parquet", [docs[5], None, docs[6]])
    empty = tmp_path / "c.jsonl"
    empty.write_text("")
    r = prepare([jsonl, table, empty], tmp_path / "out", "--skip-bad-records")
    assert r.rc == 0, r.err
    inputs = json.loads((tmp_path / "out" / "manifest.json").read_text())["inputs"]
    assert [(i["documents"], i["skipped"]) for i in inputs] == [(5, 4), (2, 1), (0, 0)]
    assert "5 bad record(s) skipped" in r.out
    # nothing good anywhere is still an error
    (tmp_path / "x.jsonl").write_text('{"text": 3}\n')
    r = prepare([empty, tmp_path / "x.jsonl"], tmp_path / "none", "--skip-bad-records")
    assert r.rc == 1 and "no documents in 2 input file(s)" in r.err, r.err


def test_without_the_data_extra(tmp_path, prepare, monkeypatch, docs):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers fails
    r = prepare([write_jsonl(tmp_path / "a.jsonl", docs[:2])], tmp_path / "out")
    assert r.rc == 1 and "pip install 'meshkeeper[data]'" in r.err


def test_a_full_disk_is_one_line_and_no_manifest(tmp_path, prepare, docs):
    data = write_jsonl(tmp_path / "a.jsonl", docs)
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        r = prepare([data], disk / "out", "--shard-tokens", 4096)
        assert r.rc == 1 and "No space left on device" in r.err, r.err
        assert f"meshkeeper: {disk / 'out'}" in r.err and "no manifest was written" in r.err
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
        assert not (disk / "out" / "manifest.json").exists()
