"""A GPU rank's batches come through the prefetcher (worker/trainer/prefetch.py): page-locked,
read a step ahead, and equal to what the rank would read itself, in order or not."""

from __future__ import annotations

import pytest
import torch

from services.spec import parse_spec
from tests.stack import tiny_spec
from worker.trainer.data import Batches
from worker.trainer.prefetch import Prefetcher

pytestmark = pytest.mark.gpu


def test_prefetched_batches_are_page_locked_and_the_ones_each_step_reads():
    spec = parse_spec(tiny_spec("prefetch", parallel={"dp": 2}))
    batches = Batches(spec.data, spec.model, spec.train.global_batch, 2)
    prefetch = Prefetcher(batches, dp_rank=1)
    for step in (0, 1, 2, 7, 3):  # in order, then a jump (a restore), then back
        x, y = prefetch.local(step)
        want_x, want_y = batches.local(step, 1)
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, want_x) and torch.equal(y, want_y), step
