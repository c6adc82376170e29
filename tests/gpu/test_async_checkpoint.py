"""An async checkpoint's staging on a GPU (worker/trainer/checkpoint.py `staging_options`):
once staging has completed, the training may overwrite the tensors, and the checkpoint still
holds their values at the save."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager

from worker.trainer.checkpoint import staging_options

pytestmark = pytest.mark.gpu


def test_a_tensor_overwritten_after_staging_is_saved_as_it_was(tmp_path):
    device = torch.device("cuda", 0)
    gen = torch.Generator(device).manual_seed(0)
    state = {f"w{i}": torch.randn(4096, 4096, device=device, generator=gen) for i in range(8)}
    before = {k: v.cpu() for k, v in state.items()}
    stager = DefaultStager(staging_options(device))
    try:
        resp = dcp.async_save(state, checkpoint_id=str(tmp_path), async_stager=stager)
        resp.staging_completion.result()
        for v in state.values():  # what the next optimizer step would do, on the same stream
            v.mul_(-1.0).add_(1.0)
        resp.upload_completion.result()
    finally:
        stager.close()
    loaded = {k: torch.empty_like(v) for k, v in before.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert all(torch.equal(loaded[k], before[k]) for k in before)
