"""Over one epoch, the trainer's batches read every packed window of a prepared training split
exactly once, and no held-out document ever: a corpus of real text in JSONL, JSONL.gz and
Parquet files, tokenized by a real `tokenizers` BPE."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer

from dataset.format import docs_path, read_manifest
from dataset.tokens import TokenStream
from services.spec import parse_spec
from tests.corpus import prepared, stdlib_docstrings
from tests.stack import tiny_spec
from worker.trainer.data import Batches

SEQ, BATCH = 64, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    texts = stdlib_docstrings(300_000)
    directory = tmp_path_factory.mktemp("corpus")
    out, _ = prepared(texts, directory, vocab=512, val_fraction=0.2)
    return texts, out, Tokenizer.from_file(str(directory / "tokenizer.json"))


def spec_for(out, dp: int = 1):
    spec = tiny_spec("epochs", parallel={"dp": dp}, train={"steps": 4, "global_batch": BATCH})
    spec["model"] = {**spec["model"], "seq_len": SEQ, "vocab": 512}
    spec["data"] = {"source": f"dataset:{out}", "seed": 11}
    return parse_spec(spec)


def documents(out, split: str) -> list[list[int]]:
    """The split's documents as token lists, cut at docs.bin's end offsets."""
    stream = TokenStream.of_split(out, read_manifest(out), split)
    ends = np.fromfile(docs_path(out, split), dtype="<u8")
    starts = np.concatenate(([0], ends[:-1]))
    return [stream.read(int(a), int(b - a)).tolist() for a, b in zip(starts, ends, strict=True)]


def test_one_epoch_reads_every_training_window_once(corpus):
    _, out, _ = corpus
    manifest = read_manifest(out)
    spec = spec_for(out, dp=2)
    batches = Batches(spec.data, spec.model, BATCH, dp=2)
    windows = batches.source.windows
    assert windows == (manifest.splits["train"].tokens - 1) // SEQ > 10 * BATCH
    stream = TokenStream.of_split(out, manifest, "train")
    every = Counter(tuple(stream.read(i * SEQ, SEQ + 1).tolist()) for i in range(windows))
    read: Counter = Counter()
    full, rest = divmod(windows, BATCH)
    for step in range(full):
        assert batches.epoch(step) == 0
        for rank in range(2):
            x, y = batches.local(step, rank)
            read.update(tuple(a + b[-1:]) for a, b in zip(x.tolist(), y.tolist(), strict=True))
    # the epoch's last `rest` windows open the step that straddles into epoch 1
    tail = batches.source.train(range(full * BATCH, full * BATCH + rest))
    read.update(tuple(w) for w in tail.tolist())
    assert read == every  # each training window exactly once, nothing else
    assert batches.epoch(full + 1) == 1


def test_no_held_out_document_is_in_the_training_split(corpus):
    texts, out, tokenizer = corpus
    train, val = documents(out, "train"), documents(out, "val")
    manifest = read_manifest(out)
    assert len(val) == manifest.splits["val"].documents > 0
    assert all(doc[-1] == manifest.eos_id for doc in train + val)
    decoded_train = {tokenizer.decode(d[:-1]) for d in train}
    decoded_val = {tokenizer.decode(d[:-1]) for d in val}
    assert not decoded_train & decoded_val
    assert decoded_train | decoded_val == set(texts)  # every document, in one split only
