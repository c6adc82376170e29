"""Corpus files in, documents out: INPUT arguments expanded to files, each file read as
records that carry their location (docs/data.md, "Preparing a dataset").

A bad record (malformed JSON, a missing or non-string text field, text that is not UTF-8)
comes out as a Record with a `problem`, so that the caller either fails on it or counts it
(--skip-bad-records); a file that cannot be read at all is a DatasetError.
"""

from __future__ import annotations

import glob
import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from dataset.format import DatasetError

SUFFIXES = (".jsonl.gz", ".jsonl", ".parquet", ".txt")
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a Parquet file never has to fit in memory
JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    split_on_blank_lines: bool = False


@dataclass(frozen=True)
class Record:
    """A document (`text`) or a bad record (`problem`, with its fix), `where` it is, and how
    many bytes of its file reading has come through after it (`pos`, for progress)."""

    where: str
    text: str | None
    problem: str = ""
    pos: int = 0


def suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _known(path: Path) -> Path:
    if suffix(path) is None:
        raise DatasetError(
            f"{path}: unknown input format {path.suffix or '(no extension)'}; inputs are "
            f"{', '.join(SUFFIXES)} files: convert it, or name it by its format"
        )
    return path


def _under(directory: Path) -> list[Path]:
    # In a directory only files of a known format count (a README beside the data is not
    # data); hidden files and directories (.git, editor files) are left out.
    files = [
        f
        for f in directory.rglob("*")
        if f.is_file()
        and suffix(f)
        and not any(part.startswith(".") for part in f.relative_to(directory).parts)
    ]
    if not files:
        raise DatasetError(f"{directory} holds no {', '.join(SUFFIXES)} file")
    return files


def expand(args: list[str]) -> list[Path]:
    """The files INPUT arguments name (files, directories recursively, globs), each once,
    sorted by path: the order of the arguments does not change the dataset."""
    found: dict[Path, Path] = {}
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            files = _under(path)
        elif path.is_file():
            files = [_known(path)]
        elif glob.has_magic(arg):
            matches = sorted(Path(m) for m in glob.glob(arg, recursive=True))
            if not matches:
                raise DatasetError(f"{arg} matches no file")
            files = [f for m in matches for f in (_under(m) if m.is_dir() else [_known(m)])]
        else:
            raise DatasetError(f"{arg} does not exist")
        for f in files:
            found.setdefault(f.resolve(), f)
    return sorted(found.values(), key=str)


def records(path: Path, opts: ReadOptions) -> Iterator[Record]:
    kind = suffix(path)
    if kind == ".parquet":
        return _parquet(path, opts.text_field)
    if kind == ".txt":
        return _blocks(path) if opts.split_on_blank_lines else _whole(path)
    return _jsonl(path, opts.text_field, gz=kind == ".jsonl.gz")


def _not_utf8(where: str, e: UnicodeDecodeError) -> str:
    return (
        f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8 "
        "(e.g. with iconv)"
    )


def _whole(path: Path) -> Iterator[Record]:
    data = path.read_bytes()
    try:
        yield Record(str(path), data.decode("utf-8"), pos=len(data))
    except UnicodeDecodeError as e:
        yield Record(str(path), None, _not_utf8(str(path), e), len(data))


def _blocks(path: Path) -> Iterator[Record]:
    """One record per run of non-blank lines; `where` is its first line."""
    block: list[bytes] = []
    start = pos = 0
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            pos += len(line)
            if line.strip():
                start = start if block else n
                block.append(line)
            elif block:
                yield _block(path, start, block, pos)
                block = []
    if block:
        yield _block(path, start, block, pos)


def _block(path: Path, start: int, lines: list[bytes], pos: int) -> Record:
    where = f"{path}:{start}"
    try:
        return Record(where, b"".join(lines).decode("utf-8").rstrip("\r\n"), pos=pos)
    except UnicodeDecodeError as e:
        return Record(where, None, _not_utf8(where, e), pos)


def _jsonl(path: Path, field: str, gz: bool) -> Iterator[Record]:
    with path.open("rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if gz else raw
        try:
            for n, line in enumerate(f, 1):
                if line.strip():  # blank lines (a trailing one, say) hold no record
                    yield _json_record(line, field, f"{path}:{n}", raw.tell())
        except (OSError, EOFError, zlib.error) as e:
            raise DatasetError(
                f"{path}: not a readable gzip file ({e}); it is corrupt or cut short: "
                "compress it again"
            ) from None


def _json_record(line: bytes, field: str, where: str, pos: int) -> Record:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as u:
            return Record(where, None, _not_utf8(where, u), pos)
        return Record(where, None, f"{where}: not JSON ({e}); fix or remove the line", pos)
    if not isinstance(value, dict):
        kind = JSON_TYPES.get(type(value), "number")
        return Record(where, None, f"{where}: a JSON {kind}, not an object; fix the line", pos)
    if field not in value:
        keys = ", ".join(map(repr, list(value)[:8])) or "none"
        return Record(
            where,
            None,
            f"{where}: no {field!r} field (it has {keys}); name the text field with --text-field",
            pos,
        )
    text = value[field]
    if not isinstance(text, str):
        kind = JSON_TYPES.get(type(text), "number")
        return Record(
            where, None, f"{where}: {field!r} is a {kind}, not a string; fix the record", pos
        )
    return Record(where, text, pos=pos)


def _parquet(path: Path, field: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        names = ", ".join(map(repr, schema.names[:8])) or "none"
        raise DatasetError(
            f"{path}: no column {field!r} (it has {names}); name the text column with --text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DatasetError(
            f"{path}: column {field!r} holds {kind}, not strings; name the text column with "
            "--text-field"
        )
    rows, size, row = max(pf.metadata.num_rows, 1), path.stat().st_size, 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                where = f"{path}, row {row}"
                row += 1
                if text is None:
                    problem = f"{where}: {field!r} is null, not a string; fix the row"
                    yield Record(where, None, problem, size * row // rows)
                else:
                    yield Record(where, text, pos=size * row // rows)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}, row {row}: cannot be read ({e})") from None
