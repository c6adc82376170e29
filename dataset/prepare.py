"""`meshkeeper data prepare`: corpus files to a prepared dataset (docs/data.md, "Preparing a
dataset").

The main process reads the documents and decides each one's split; batches of them go to
`workers` processes that tokenize, at most WINDOW_PER_WORKER batches per worker in flight, and
come back in order to be written: memory stays bounded whatever the corpus. The manifest is
written last, atomically: an interrupted run leaves none.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dataset.format import (
    MANIFEST,
    SPLITS,
    DatasetError,
    InputEntry,
    Manifest,
    SplitEntry,
    SplitRule,
    TokenizerEntry,
    read_manifest,
    sha256_file,
)
from dataset.readers import ReadOptions, expand, records
from dataset.shard_writer import SplitWriter
from dataset.split import doc_hash, val_threshold
from dataset.tokenizer import LoadedTokenizer, load

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 ids: few files, each quick to hash
DEFAULT_VAL_FRACTION = 0.01
BATCH_DOCS = 512
BATCH_BYTES = 1 << 20
WINDOW_PER_WORKER = 2  # one batch being tokenized, one queued
MANIFEST_TMP = MANIFEST + ".tmp"


def default_workers() -> int:
    return min(os.cpu_count() or 1, 8)


@dataclass(frozen=True)
class PrepareOptions:
    inputs: list[str]
    tokenizer: Path
    out: Path
    read: ReadOptions = ReadOptions()
    skip_bad_records: bool = False
    eos_id: int | None = None
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    split: SplitRule = SplitRule(seed=0, fraction=DEFAULT_VAL_FRACTION)
    workers: int = field(default_factory=default_workers)

    def recorded(self) -> dict[str, str | int | bool]:
        """The options that shape the output besides the tokenizer and the split rule."""
        return {
            "text_field": self.read.text_field,
            "split_on_blank_lines": self.read.split_on_blank_lines,
            "skip_bad_records": self.skip_bad_records,
            "shard_tokens": self.shard_tokens,
        }


@dataclass(frozen=True)
class Result:
    manifest: Manifest
    unchanged: bool  # the directory already held this very dataset: nothing was written
    eos_from: str


def prepare(opts: PrepareOptions, progress=None) -> Result:
    """Write the dataset; `progress`: a rich Progress to show the work on, or None."""
    if opts.shard_tokens < 1 or opts.workers < 1:
        raise DatasetError("--shard-tokens and --workers must be at least 1")
    files = expand(opts.inputs)
    tok = load(opts.tokenizer, opts.eos_id)
    _check_out(opts.out)
    inputs = [(str(f), f.stat().st_size, sha256_file(f)) for f in files]
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    old = _previous(opts.out)
    if old is not None and _same(old, opts, tok, dtype, inputs):
        return Result(old, True, tok.eos_from)
    _clear(opts.out)
    hashes = _all_hashes(files, opts) if opts.split.docs is not None else None
    threshold = val_threshold(opts.split, hashes)
    run = _Run(opts, tok, dtype, files, threshold, sum(size for _, size, _ in inputs), progress)
    counts, splits = run.go()
    manifest = Manifest(
        dtype=dtype,
        eos_id=tok.eos_id,
        tokenizer=TokenizerEntry(
            sha256=tok.sha256, vocab_size=tok.vocab_size, source=str(tok.path.resolve())
        ),
        split=opts.split,
        inputs=tuple(
            InputEntry(name=name, bytes=size, sha256=sha, documents=docs, skipped=skipped)
            for (name, size, sha), (docs, skipped) in zip(inputs, counts, strict=True)
        ),
        options=opts.recorded(),
        splits=splits,
    )
    _write_manifest(opts.out, manifest)
    return Result(manifest, False, tok.eos_from)


def _ours(entry: Path) -> bool:
    """Whether `entry` (in an output directory) is a file this command writes."""
    if entry.name in (MANIFEST, MANIFEST_TMP):
        return entry.is_file()
    if entry.name in SPLITS and entry.is_dir() and not entry.is_symlink():
        return all(
            f.is_file() and (f.name == "docs.bin" or _is_shard(f.name)) for f in entry.iterdir()
        )
    return False


def _is_shard(name: str) -> bool:
    return name.startswith("shard-") and name.endswith(".bin") and name[6:-4].isdigit()


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DatasetError(f"--out {out} is a file; name a new or empty directory")
    for entry in sorted(out.iterdir()) if out.exists() else ():
        if not _ours(entry):
            raise DatasetError(
                f"--out {out} holds {entry.name}, which `meshkeeper data prepare` did not "
                "write; refusing to write there: name a new or empty directory"
            )


def _previous(out: Path) -> Manifest | None:
    try:
        return read_manifest(out)
    except DatasetError:
        return None  # none, or unreadable: it is overwritten either way


def _same(old: Manifest, opts: PrepareOptions, tok: LoadedTokenizer, dtype: str, inputs) -> bool:
    return (
        [(i.name, i.bytes, i.sha256) for i in old.inputs] == inputs
        and (old.tokenizer.sha256, old.eos_id, old.dtype) == (tok.sha256, tok.eos_id, dtype)
        and old.split == opts.split
        and old.options == opts.recorded()
        and _complete(opts.out, old)
    )


def _complete(out: Path, manifest: Manifest) -> bool:
    """Every file the manifest names is there at its size (`data verify` checks contents)."""
    try:
        return all(
            (out / split / s.name).stat().st_size == s.tokens * manifest.itemsize()
            for split, entry in manifest.splits.items()
            for s in entry.shards
        ) and all(
            (out / split / "docs.bin").stat().st_size == entry.documents * 8
            for split, entry in manifest.splits.items()
        )
    except OSError:
        return False


def _clear(out: Path) -> None:
    # The manifest goes first and durably: from here until the new one is written, the
    # directory is not a dataset, whatever becomes of this run.
    out.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, MANIFEST_TMP):
        (out / name).unlink(missing_ok=True)
    _fsync_dir(out)
    for split in SPLITS:
        if (out / split).is_dir():
            for f in (out / split).iterdir():
                f.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(out: Path, manifest: Manifest) -> None:
    for split in SPLITS:
        if (out / split).is_dir():
            _fsync_dir(out / split)  # the shards' directory entries, before a manifest names them
    tmp = out / MANIFEST_TMP
    with tmp.open("w") as f:
        f.write(manifest.model_dump_json(indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MANIFEST)
    _fsync_dir(out)


def _documents(path: Path, opts: PrepareOptions, counts: list[int]) -> Iterator:
    """`path`'s good records; bad ones fail the run, or are counted in counts[1]."""
    for record in records(path, opts.read):
        if record.text is None:
            if not opts.skip_bad_records:
                raise DatasetError(
                    f"{record.problem} (or pass --skip-bad-records to leave such records out)"
                )
            counts[1] += 1
        elif record.text:  # an empty text is no document: it would be a lone EOS
            counts[0] += 1
            yield record
    if counts == [0, 0] and not opts.skip_bad_records:
        raise DatasetError(
            f"{path} holds no documents; leave it out of the inputs (or check --text-field)"
        )


def _all_hashes(files: list[Path], opts: PrepareOptions) -> Iterator[int]:
    for path in files:
        for record in _documents(path, opts, [0, 0]):
            yield doc_hash(record.text, opts.split.seed)


@dataclass
class _Batch:
    texts: list[str] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)
    val: list[bool] = field(default_factory=list)
    size: int = 0
    done: int = 0  # input bytes read once this batch is through, for the progress bar


class _Run:
    def __init__(self, opts, tok: LoadedTokenizer, dtype, files, threshold, total, progress):
        self.opts, self.tok, self.dtype, self.files = opts, tok, dtype, files
        self.threshold, self.progress = threshold, progress
        if progress is not None:
            self.task = progress.add_task("prepare", total=total, docs=0, tokens=0)
        self.counts = [[0, 0] for _ in files]
        self.writers = {s: SplitWriter(opts.out / s, dtype, opts.shard_tokens) for s in SPLITS}

    def go(self) -> tuple[list[list[int]], dict[str, SplitEntry]]:
        pool = ProcessPoolExecutor(
            self.opts.workers,
            multiprocessing.get_context("spawn"),  # no fork of a process that runs threads
            initializer=_init_worker,
            initargs=(self.tok.json, self.tok.eos_id, self.tok.vocab_size, self.dtype, os.getpid()),
        )
        # An ordered window of futures, not Pool.imap: imap reads its whole input ahead
        window: deque[tuple[_Batch, Future]] = deque()
        try:
            for batch in self._batches():
                window.append((batch, pool.submit(_encode, batch.texts)))
                batch.texts = []
                if len(window) >= WINDOW_PER_WORKER * self.opts.workers:
                    self._write(*window.popleft())
            while window:
                self._write(*window.popleft())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        splits = {s: w.close() for s, w in self.writers.items()}
        if not splits["train"].documents:
            raise DatasetError(
                "every document went to the val split; lower --val-fraction or --val-docs"
            )
        if not splits["val"].documents:  # no val split rather than an empty one
            del splits["val"]
            for f in (self.opts.out / "val").iterdir():
                f.unlink()
            (self.opts.out / "val").rmdir()
        return self.counts, splits

    def _batches(self) -> Iterator[_Batch]:
        batch, before = _Batch(), 0
        for path, counts in zip(self.files, self.counts, strict=True):
            for record in _documents(path, self.opts, counts):
                batch.texts.append(record.text)
                batch.wheres.append(record.where)
                batch.val.append(doc_hash(record.text, self.opts.split.seed) < self.threshold)
                batch.size += len(record.text)
                batch.done = before + record.pos
                if len(batch.texts) >= BATCH_DOCS or batch.size >= BATCH_BYTES:
                    yield batch
                    batch = _Batch()
            before += path.stat().st_size
        if batch.wheres:
            yield batch
        if not any(docs for docs, _ in self.counts):
            raise DatasetError(
                f"no documents in {len(self.files)} input file(s); check the inputs and "
                "--text-field"
            )

    def _write(self, batch: _Batch, future: Future) -> None:
        ids, lengths, bad = future.result()
        if bad is not None:
            doc, token = bad
            raise DatasetError(
                f"{batch.wheres[doc]}: the tokenizer gave id {token}, not below its "
                f"vocabulary size {self.tok.vocab_size}; its tokenizer.json is inconsistent: "
                "use the model's own tokenizer.json"
            )
        val = np.array(batch.val)
        if not val.any():
            self.writers["train"].add(ids, lengths)
        elif val.all():
            self.writers["val"].add(ids, lengths)
        else:
            in_val = np.repeat(val, lengths)
            self.writers["train"].add(ids[~in_val], lengths[~val])
            self.writers["val"].add(ids[in_val], lengths[val])
        if self.progress is not None:
            self.progress.update(self.task, completed=batch.done)
            fields = self.progress.tasks[self.task].fields
            fields["docs"] += len(lengths)
            fields["tokens"] += len(ids)


_WORKER: tuple | None = None


def _init_worker(tok_json: str, eos_id: int, vocab_size: int, dtype: str, parent: int) -> None:
    from tokenizers import Tokenizer

    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # One thread per process: --workers is the parallelism, not tokenizers' own thread pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _WORKER = (Tokenizer.from_str(tok_json), eos_id, vocab_size, np.dtype(dtype))


def _exit_with_parent(parent: int) -> None:
    # A parent killed outright (SIGKILL, the OOM killer) cannot stop its workers; they would
    # wait on its queue for ever.
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, tuple[int, int] | None]:
    """The documents' ids back to back, each ending with EOS; each one's length; and, for
    an id outside the vocabulary, (document, id) of the first."""
    tok, eos_id, vocab_size, dtype = _WORKER
    flat: list[int] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, enc in enumerate(tok.encode_batch(texts)):
        ids = enc.ids
        flat.extend(ids)
        # a post-processor may end each encoding with EOS already (T5's does): not twice
        if not ids or ids[-1] != eos_id:
            flat.append(eos_id)
        lengths[i] = len(ids) + (not ids or ids[-1] != eos_id)
    out = np.array(flat, dtype=np.uint32)
    if len(out) and int(out.max()) >= vocab_size:
        first = int(np.argmax(out >= vocab_size))
        doc = int(np.searchsorted(np.cumsum(lengths), first, side="right"))
        return out[:0], lengths, (doc, int(out[first]))
    return out.astype(dtype), lengths, None
