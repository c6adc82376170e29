"""A real corpus nobody here wrote, and a real tokenizer trained on it: the docstrings of
Python's standard library, as JSONL, JSONL.gz and Parquet documents, prepared through
`dataset.prepare` (what `meshkeeper data prepare` runs)."""

from __future__ import annotations

import ast
import gzip
import json
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dataset.format import SplitRule
from dataset.prepare import PrepareOptions, Result, prepare

EOS = "<|endoftext|>"


def stdlib_docstrings(limit_bytes: int) -> list[str]:
    """Module, class and function docstrings of the standard library, in a stable order,
    until `limit_bytes` of text."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append(doc)
                    total += len(doc.encode())
                    if total >= limit_bytes:
                        return out
    return out


def bpe_tokenizer(texts: list[str], vocab: int, path: Path) -> Path:
    """A byte-level BPE of `vocab` ids (the EOS among them) trained on `texts`, saved."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def write_inputs(texts: list[str], directory: Path) -> list[Path]:
    """`texts` in thirds: a .jsonl, a .jsonl.gz and a .parquet file."""
    directory.mkdir(parents=True, exist_ok=True)
    a, b, c = (
        texts[: len(texts) // 3],
        texts[len(texts) // 3 : 2 * len(texts) // 3],
        texts[2 * len(texts) // 3 :],
    )
    plain, packed, table = directory / "a.jsonl", directory / "b.jsonl.gz", directory / "c.parquet"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in a))
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in b)
    pq.write_table(pa.table({"text": c}), table)
    return [plain, packed, table]


def prepared(
    texts: list[str], directory: Path, vocab: int = 512, val_fraction: float = 0.1
) -> tuple[Path, Result]:
    """`texts` prepared under `directory/dataset` with a BPE trained on them."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = bpe_tokenizer(texts, vocab, directory / "tokenizer.json")
    out = directory / "dataset"
    result = prepare(
        PrepareOptions(
            inputs=[str(p) for p in write_inputs(texts, directory / "corpus")],
            tokenizer=tokenizer,
            out=out,
            split=SplitRule(seed=0, fraction=val_fraction),
            workers=2,
        )
    )
    return out, result
