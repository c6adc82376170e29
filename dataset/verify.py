"""`meshkeeper data verify DIR`: every file of a prepared dataset against its manifest
(sizes, sha256), then what the hashes cannot show: that the document index is in order,
that every document ends with EOS and that every id is inside the vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataset.format import (
    MANIFEST,
    DatasetError,
    Manifest,
    docs_path,
    read_manifest,
    shard_path,
    verify_files,
)

CHUNK_TOKENS = 1 << 24


def verify(directory: Path, progress=None) -> Manifest:
    manifest = read_manifest(directory)
    if progress is not None:
        task = progress.add_task("sha256", total=None)
        hashed = lambda done, total: progress.update(task, completed=done, total=total)  # noqa: E731
    verify_files(directory, manifest, 1, hashed if progress is not None else lambda d, t: None)
    if progress is not None:
        total = sum(e.tokens for e in manifest.splits.values()) * manifest.itemsize()
        task = progress.add_task("ids", total=total)
    for split, entry in manifest.splits.items():
        ends = np.fromfile(docs_path(directory, split), dtype="<u8")
        if len(ends) and (np.any(np.diff(ends.astype(np.int64)) <= 0) or ends[-1] != entry.tokens):
            raise DatasetError(
                f"{docs_path(directory, split)}: the document ends are not increasing up to "
                f"{entry.tokens}; prepare the dataset again"
            )
        if sum(s.tokens for s in entry.shards) != entry.tokens:
            raise DatasetError(f"{Path(directory) / MANIFEST}: {split}'s shards do not add up")
        start = 0
        for shard in entry.shards:
            path = shard_path(directory, split, shard.name)
            ids = np.memmap(path, dtype=np.dtype(manifest.dtype).newbyteorder("<"), mode="r")
            for at in range(0, len(ids), CHUNK_TOKENS):
                top = int(ids[at : at + CHUNK_TOKENS].max())
                if top >= manifest.tokenizer.vocab_size:
                    raise DatasetError(
                        f"{path}: id {top} is outside the tokenizer's "
                        f"{manifest.tokenizer.vocab_size} ids; prepare the dataset again"
                    )
                if progress is not None:
                    progress.advance(task, min(CHUNK_TOKENS, len(ids) - at) * manifest.itemsize())
            # the last id of each document that ends in this shard
            here = ends[(ends > start) & (ends <= start + len(ids))].astype(np.int64) - start - 1
            wrong = here[ids[here] != manifest.eos_id]
            if len(wrong):
                raise DatasetError(
                    f"{path}: the document ending at id {int(wrong[0])} does not end with EOS "
                    f"({manifest.eos_id}); prepare the dataset again"
                )
            start += len(ids)
    return manifest
