"""The planner's model of the snapshot rings (services/planner/snapshot_memory.py), which
admission holds to the room each agent registered, against what a real trainer writes: two
gloo ranks snapshot every step for 20 steps, long enough for every slot of their rings to be
written, and the memory their own ring files took (allocated blocks, as tmpfs charges them) is
the model's `own` bytes within a few percent: at zero 0 with the replica check's pinned slot,
and at zero 3, whose logged steps FSDP reduces straight into their slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.admission import PoolWorker, _plan
from services.planner.snapshot_memory import snapshot_rings
from services.spec import parse_spec
from tests.launch import run_trainer
from worker.snapshots import SnapshotPlan

STEPS = 20


def ring_files_bytes(rank_dir: Path) -> int:
    """Memory the rank's own slot files hold (their manifests are a few KB more)."""
    files = [*rank_dir.glob("slot-*.bin"), *rank_dir.glob("grads-*.bin")]
    return sum(f.stat().st_blocks * 512 for f in files)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_ranks_own_rings_take_what_the_planner_says(tmp_path, zero):
    spec = {
        "name": f"ring-bytes-{zero}",
        "model": {"preset": "tiny"},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2, "zero": zero},
        "train": {"steps": STEPS, "global_batch": 8, "lr": 1e-3},
    }
    plan = SnapshotPlan(tmp_path / "snapshots", 1, 1, 2, {0: 1, 1: 0}, full_every=4)
    plan_file = tmp_path / "snapshot.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    run_trainer(spec, tmp_path / "run", extra=["--snapshot-plan", str(plan_file)])

    job = parse_spec(spec)
    rings = snapshot_rings(job, _plan(job, [PoolWorker("w0", 1, 2**34, "cpu")]).memory)
    assert rings.whole_slots == (3 if zero == 0 else 2)  # the replica check pins one more
    assert rings.logged_slots == 5
    for rank in (0, 1):
        got = ring_files_bytes(plan.own_dir(rank))
        assert got == pytest.approx(rings.own, rel=0.05), (rank, got, rings)
