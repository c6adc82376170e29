"""A snapshot's copy from GPU memory into its slot in /dev/shm (worker/trainer/snapshot.py
`map_file`, worker/trainer/snapshot_state.py `copy_into`): every byte lands, and the
bandwidth goes to `make gpu-check`'s summary."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch

from worker.trainer.snapshot import map_file
from worker.trainer.snapshot_state import aligned, copy_into

pytestmark = pytest.mark.gpu

TENSORS, NUMEL = 16, 32 * 2**20  # 16 tensors of 128 MiB in fp32: 2 GiB


def test_a_snapshot_copy_from_the_gpu_is_exact(measured):
    gen = torch.Generator("cuda").manual_seed(0)
    src = [torch.randn(NUMEL, device="cuda", generator=gen) for _ in range(TENSORS)]
    size = aligned(NUMEL * 4)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        image = map_file(Path(d) / "slot-0", TENSORS * size)
        dst = [image[i * size : i * size + NUMEL * 4].view(torch.float32) for i in range(TENSORS)]
        copy_into(dst, [(str(i), t) for i, t in enumerate(src)])  # first touch: page faults
        torch.cuda.synchronize()
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            copy_into(dst, [(str(i), t) for i, t in enumerate(src)])
            torch.cuda.synchronize()
            rates.append(TENSORS * NUMEL * 4 / (time.perf_counter() - t0) / 1e9)
        exact = all(torch.equal(d_.to("cuda"), s) for d_, s in zip(dst, src, strict=True))
        del dst, image
    measured("snapshot_copy_gb_per_s", max(rates))
    assert exact
