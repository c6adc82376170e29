"""A token stream read through memory maps: one flat file (`text:`, `tokens:`) or a prepared
split's shards back to back (`dataset:`). A rank maps each file once and unmaps the pages of
each window once read, so its memory does not grow with the dataset (docs/data.md, "Memory").
"""

from __future__ import annotations

import bisect
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from dataset.format import DatasetError, Manifest, shard_path


class MappedFile:
    """A file mapped read-only as an array of `dtype`."""

    def __init__(self, path: str | Path, dtype: str, field: str):
        # The agent hands over the path it resolved under its data roots (services/paths.py);
        # O_NOFOLLOW refuses a link swapped in since, and fstat checks what was really opened.
        refused = DatasetError(
            f"{field}: {path} does not exist or is not a readable, non-empty regular file "
            "(links are not followed); fix the path"
        )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise refused from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise refused
            self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # keeps its own reference
        finally:
            os.close(fd)
        itemsize = np.dtype(dtype).itemsize
        self.ids = np.frombuffer(self.map, dtype=np.dtype(dtype).newbyteorder("<"))[
            : st.st_size // itemsize
        ]

    def __len__(self) -> int:
        return len(self.ids)

    def copy(self, out: np.ndarray, start: int, count: int) -> None:
        """ids [start, start + count) into `out`, then unmap the pages that held them. Pages
        of a file mapping stay in this process's RSS once touched, and the kernel maps a whole
        large folio per fault (MBs): a long run would map most of a large dataset. Dropping
        the mapping leaves the page cache as it was; the next read maps it again."""
        out[:] = self.ids[start : start + count]
        size = self.ids.itemsize
        first = start * size // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        self.map.madvise(mmap.MADV_DONTNEED, first, (start + count) * size - first)


class TokenStream:
    """Token ids [0, len) over one or more mapped files, read as int64 slices."""

    def __init__(self, parts: list[MappedFile]):
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))

    @classmethod
    def of_file(cls, path: str, dtype: str) -> TokenStream:
        return cls([MappedFile(path, dtype, "data.source")])

    @classmethod
    def of_split(cls, directory: str | Path, manifest: Manifest, split: str) -> TokenStream:
        entry = manifest.splits.get(split)
        parts = []
        for shard in entry.shards if entry else ():
            path = shard_path(directory, split, shard.name)
            m = MappedFile(path, manifest.dtype, "data.source")
            if len(m) != shard.tokens:
                raise DatasetError(
                    f"{path} holds {len(m)} tokens where the manifest says {shard.tokens}; "
                    "prepare the dataset again"
                )
            parts.append(m)
        return cls(parts)

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        """Ids [start, start + length) as int64, across file boundaries."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = bisect.bisect_right(self.starts, start) - 1
        while filled < length:
            part, offset = self.parts[i], start + filled - self.starts[i]
            take = min(length - filled, len(part) - offset)
            part.copy(out[filled : filled + take], offset, take)
            filled += take
            i += 1
        return out
