"""A real-size model on this machine (issue 12): the 1b preset cut to 4 layers and 128-token
sequences trains at dp2 x pp2 x tp2 (8 processes), every rank within twice its share of
parameters, gradients and Adam state plus 1.5 GiB. Meta-device construction is what lets it
start: no rank ever builds the whole 0.7B-parameter model (worker/trainer/step.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.mesh import MeshShape
from services.spec import parse_spec
from tests.launch import run_trainer
from worker.trainer.model import build_model
from worker.trainer.pipeline import split_stages

SPEC = {
    "name": "real-size",
    "model": {"preset": "1b", "layers": 4, "seq_len": 128},
    "data": {"source": "synthetic", "seed": 1},
    # zero 3 (the default); the fewest samples dp2 x pp2 allows: one per microbatch
    "parallel": {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2},
    "train": {"steps": 2, "global_batch": 4, "warmup_steps": 1},
}
# fp32 parameter, gradient, and Adam's two moments
BYTES_PER_PARAM = 4 * 4
SLACK = 1.5 * 2**30


def share_bytes(pp_rank: int) -> float:
    """One rank's share of its stage's parameters, gradients and Adam state: the stage split
    over its dp x tp ranks (the few norm weights TP replicates are counted as split too)."""
    spec = parse_spec(SPEC)
    p = spec.parallel
    full = build_model(spec.model, spec.train.seed, "meta")
    params = sum(q.numel() for _, part in split_stages(full, pp_rank, p) for q in part.parameters())
    return params * BYTES_PER_PARAM / (p.dp * p.tp)


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# What the eight ranks take together, measured on the 24 GiB build machine inside a 21.5 GiB
# memory cgroup (issue 12): 19.9 to 20.7 GiB at the peak in three runs (step 2, Adam's state
# alive through forward and backward), every rank at 2.35-3.05 GiB against its bound of 4.21.
# The peak depends on how the ranks' backward passes line up, so this asks for 1.3 GiB more.
NEEDS_AVAILABLE = 22 * 2**30


@pytest.mark.slow
def test_1b_cut_to_4_layers_trains_at_dp2_pp2_tp2_within_memory(tmp_path):
    shape = MeshShape(2, 2, 2)
    if available_bytes() < NEEDS_AVAILABLE:
        pytest.skip(
            f"needs {NEEDS_AVAILABLE / 2**30:.0f} GiB available for 8 ranks at the 1b preset, "
            f"{available_bytes() / 2**30:.1f} GiB are"
        )
    run_trainer(
        SPEC, tmp_path, extra=["--metrics-out", str(tmp_path / "steps-{rank}.jsonl")], timeout=900
    )
    for rank in range(shape.world_size):
        lines = (tmp_path / f"steps-{rank}.jsonl").read_text().splitlines()
        steps = [r for r in map(json.loads, lines) if "event" not in r]
        assert [r["step"] for r in steps] == [1, 2], f"rank {rank}: {steps}"
        assert all(math.isfinite(r["loss"]) for r in steps), f"rank {rank}: {steps}"
        peak = steps[-1]["peak_mem_bytes"]  # the process's peak over the whole run
        limit = 2 * share_bytes(shape.coord(rank).pp) + SLACK
        assert peak <= limit, (
            f"rank {rank}: peak {peak / 2**30:.2f} GiB over {limit / 2**30:.2f} GiB "
            "(2x its parameters, gradients and Adam state + 1.5 GiB)"
        )
