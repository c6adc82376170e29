"""Which split a document goes to: a seeded hash of its text alone, so that where a document
lands does not depend on which files, or which other documents, are prepared with it."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable

from dataset.format import SplitRule

HASH_SPACE = 1 << 64


def doc_hash(text: str, seed: int) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little")


def val_threshold(rule: SplitRule, hashes: Iterable[int] | None = None) -> int:
    """Documents whose hash is below this go to val.

    --val-fraction F: F of the hash space, whatever else is prepared. --val-docs N: just past
    the N smallest `hashes` (every document's, read beforehand), so adding documents can
    only move val documents into train, never a train document into val: what a model
    trained on an earlier dataset saw never turns up in a later val split."""
    if rule.docs is None:
        return int((rule.fraction or 0) * HASH_SPACE)
    if rule.docs == 0:
        return 0
    smallest = heapq.nsmallest(rule.docs, hashes or ())
    return smallest[-1] + 1 if smallest else 0
