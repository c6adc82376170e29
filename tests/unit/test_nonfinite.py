"""A non-finite loss stops training with an error that names the step."""

import math
import os

import pytest
import torch
import torch.distributed as dist

from services.spec import parse_spec
from worker.trainer.distributed import init_distributed, shutdown_distributed
from worker.trainer.parallel import ParallelDims, RankContext
from worker.trainer.step import NonFiniteError, Trainer

RDZV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single_rank():
    assert not any(v in os.environ for v in RDZV_VARS), "run pytest outside torchrun"
    yield init_distributed(timeout_s=30)  # sets the variables for a one-rank world
    shutdown_distributed()
    for var in RDZV_VARS:
        os.environ.pop(var, None)


def test_nan_weight_stops_at_that_step(single_rank):
    rank, _, device = single_rank
    spec = parse_spec(
        {"name": "nan", "model": {"preset": "tiny"}, "train": {"steps": 3, "global_batch": 2}}
    )
    dims = ParallelDims(spec.parallel, device.type)
    trainer = Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device))
    first = trainer.train_step(0)
    assert first.step == 1 and math.isfinite(first.loss)  # step counts steps completed
    with torch.no_grad():
        trainer.parts[0].layers["1"].mlp.up.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="step 2: loss nan"):  # the second step
        trainer.train_step(1)
    assert dist.is_initialized()
