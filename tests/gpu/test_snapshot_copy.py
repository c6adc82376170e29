"""A snapshot's copy from GPU memory into its slot in /dev/shm (worker/trainer/snapshot.py
`Ring`, worker/trainer/snapshot_state.py `copy_into`), on a side stream as the snapshot
thread makes it: every byte lands, into a page-locked slot (a GPU rank's own ring) and into a
pageable one alike, and both bandwidths go to `make gpu-check`'s summary."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch

from worker.snapshots import HEADER_BYTES
from worker.trainer.snapshot import Ring
from worker.trainer.snapshot_state import aligned, copy_into

pytestmark = pytest.mark.gpu

TENSORS, NUMEL = 16, 32 * 2**20  # 16 tensors of 128 MiB in fp32: 2 GiB


def copy_rate(src: list[torch.Tensor], page_lock: bool) -> tuple[float, bool, bool]:
    """(best GB/s of three copies after a first, whether every byte landed, whether the slot
    was page-locked)."""
    size = aligned(NUMEL * 4)
    side = torch.cuda.Stream()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        ring = Ring(Path(d), keep=1, page_lock=page_lock)
        _, bin_path, _, image = ring.claim(HEADER_BYTES + TENSORS * size)
        dst = [
            image[HEADER_BYTES + i * size :][: NUMEL * 4].view(torch.float32)
            for i in range(TENSORS)
        ]
        tensors = [(str(i), t) for i, t in enumerate(src)]
        rates = []
        for attempt in range(4):  # the first pays for page faults where the slot is pageable
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                copy_into(dst, tensors)
            side.synchronize()
            if attempt:
                rates.append(TENSORS * NUMEL * 4 / (time.perf_counter() - t0) / 1e9)
        exact = all(torch.equal(d_.to("cuda"), s) for d_, s in zip(dst, src, strict=True))
        locked = bin_path in ring.locked
        ring._forget(bin_path)  # unlocks before the directory goes
        del dst, image
    return max(rates), exact, locked


def test_a_snapshot_copy_from_the_gpu_is_exact_and_page_locked_is_faster(measured):
    gen = torch.Generator("cuda").manual_seed(0)
    src = [torch.randn(NUMEL, device="cuda", generator=gen) for _ in range(TENSORS)]
    pageable, pageable_exact, _ = copy_rate(src, page_lock=False)
    locked, locked_exact, was_locked = copy_rate(src, page_lock=True)
    measured("snapshot_copy_gb_per_s_pageable", pageable)
    measured("snapshot_copy_gb_per_s_page_locked", locked)
    measured("snapshot_copy_page_locked_over_pageable", locked / pageable)
    assert pageable_exact and locked_exact
    assert was_locked, "the driver refused to page-lock the slot"
    assert locked > pageable, (locked, pageable)  # sanity only: the ratio is in the summary
