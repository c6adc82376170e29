"""A token stream read through memory maps: one flat file (`text:`, `tokens:`) or a prepared
split's shards back to back (`dataset:`). A rank maps each file once; only the pages its
windows touch become resident, and they are the kernel's page cache, dropped under pressure
(docs/data.md, "Memory").
"""

from __future__ import annotations

import bisect
import os
import stat
from pathlib import Path

import numpy as np

from dataset.format import DatasetError, Manifest, shard_path


def map_file(path: str | Path, dtype: str, field: str) -> np.memmap:
    """`path` mapped read-only as `dtype`. The agent hands over the path it resolved under its
    data roots (services/paths.py); O_NOFOLLOW refuses a link swapped in since, and fstat
    checks what was really opened."""
    refused = DatasetError(
        f"{field}: {path} does not exist or is not a readable, non-empty regular file "
        "(links are not followed); fix the path"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise refused from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        os.close(fd)
        raise refused
    with os.fdopen(fd, "rb") as f:  # the map keeps its own reference to the file
        return np.memmap(f, dtype=np.dtype(dtype), mode="r")


class TokenStream:
    """Token ids [0, len) over one or more mapped files, read as int64 slices."""

    def __init__(self, parts: list[np.memmap]):
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))

    @classmethod
    def of_file(cls, path: str, dtype: str) -> TokenStream:
        return cls([map_file(path, dtype, "data.source")])

    @classmethod
    def of_split(cls, directory: str | Path, manifest: Manifest, split: str) -> TokenStream:
        entry = manifest.splits[split]
        parts = []
        for shard in entry.shards:
            path = shard_path(directory, split, shard.name)
            m = map_file(path, manifest.dtype, "data.source")
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
            out[filled : filled + take] = part[offset : offset + take]
            filled += take
            i += 1
        return out
