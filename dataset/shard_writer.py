"""One split's files as the token ids arrive: fixed-size shards and docs.bin, each hashed
while it is written (dataset/format.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from dataset.format import ShardEntry, SplitEntry


class _HashedFile:
    def __init__(self, path: Path):
        self.path, self.file, self.sha = path, path.open("wb"), hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha.update(data)

    def close(self) -> str:
        # fsync before the manifest can name the file: a manifest that survives a power cut
        # must not name a shard that did not
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.sha.hexdigest()


class SplitWriter:
    def __init__(self, directory: Path, dtype: str, shard_tokens: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.shard_tokens = directory, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[ShardEntry] = []
        self.docs = _HashedFile(directory / "docs.bin")
        self.documents = self.tokens = 0
        self._shard: _HashedFile | None = None
        self._in_shard = 0

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents back to back: `ids` all their tokens, `lengths` each one's count."""
        if not len(lengths):
            return
        ends = self.tokens + np.cumsum(lengths, dtype=np.uint64)
        self.docs.write(ends.astype("<u8").tobytes())
        self.documents += len(lengths)
        self.tokens += len(ids)
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._shard is None:
                self._shard = _HashedFile(self.dir / f"shard-{len(self.shards):05d}.bin")
            part = ids[: self.shard_tokens - self._in_shard]
            self._shard.write(part.tobytes())
            self._in_shard += len(part)
            ids = ids[len(part) :]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        name = self._shard.path.name
        self.shards.append(ShardEntry(name=name, tokens=self._in_shard, sha256=self._shard.close()))
        self._shard, self._in_shard = None, 0

    def close(self) -> SplitEntry:
        if self._shard is not None:
            self._close_shard()
        return SplitEntry(
            documents=self.documents,
            tokens=self.tokens,
            shards=tuple(self.shards),
            docs_sha256=self.docs.close(),
        )
