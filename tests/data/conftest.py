"""What the tests of `meshkeeper data` share: documents of real text and a real tokenizer
(tests/corpus.py), input files, the command run in this process, a dataset read back."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from cli.main import main
from dataset.format import docs_path, read_manifest, shard_path
from tests.corpus import bpe_tokenizer, stdlib_docstrings


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return stdlib_docstrings(400_000)[:400]


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory, docs) -> Path:
    return bpe_tokenizer(docs, 1000, tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="session")
def tok(tokenizer_file) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_file))


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    return path


def write_parquet(path: Path, texts: list, field: str = "text", row_group: int = 64) -> Path:
    pq.write_table(pa.table({field: texts}), path, row_group_size=row_group)
    return path


@dataclass
class Run:
    rc: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """`meshkeeper ARGS...` in this process: its exit code, stdout and stderr."""

    def run(*args) -> Run:
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Run(rc, out, err)

    return run


@pytest.fixture
def prepare(cli, tokenizer_file):
    """`meshkeeper data prepare INPUTS --tokenizer T --out OUT --quiet --workers 1 ...`."""

    def run(inputs: list, out: Path, *options) -> Run:
        args = ["data", "prepare", *inputs, "--tokenizer", tokenizer_file, "--out", out]
        return cli(*args, "--quiet", "--workers", 1, *options)

    return run


def split_docs(directory: Path, split: str) -> list[list[int]]:
    """Each document's ids in `split`, read back from its shards and docs.bin."""
    m = read_manifest(directory)
    if split not in m.splits:
        return []
    entry = m.splits[split]
    ids = np.concatenate(
        [np.fromfile(shard_path(directory, split, s.name), dtype=m.dtype) for s in entry.shards]
    )
    ends = np.fromfile(docs_path(directory, split), dtype="<u8").astype(np.int64)
    return [ids[a:b].tolist() for a, b in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)]
