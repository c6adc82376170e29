"""/dev/shm running full fails snapshots, never the trainer (worker/trainer/snapshot.py
`reserve`): a write to a sparse page of a mapped file that tmpfs has no room for is a SIGBUS,
which would kill the rank mid-step. Two real gloo ranks snapshot every step of a tiny FSDP
model (logged steps reduce their gradients straight into their slots) into a tmpfs with room
for about two whole snapshots; they must train to the end, report the snapshots that found no
room, and end with the bits of a run without snapshots.

The rank side is this module's `__main__`, under tests/rankrun.py.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import run_ranks, scenario_lines
from tests.tmpfs import small_tmpfs

STEPS = 12


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    with small_tmpfs(tmp_path_factory.mktemp("shm"), "4m") as shm:
        proc = run_ranks(2, "tests.unit.test_snapshot_shm_full", [str(shm)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]  # a SIGBUS ends a rank with -7
    return scenario_lines(proc)["shm-full"]


def test_the_ranks_train_to_the_end_with_the_bits_of_a_run_without_snapshots(results):
    for r in results:
        assert r["steps"] == STEPS, r
        assert r["same_as_without_snapshots"], r


def test_snapshots_without_room_are_reported_and_the_first_ones_land(results):
    errors = [e for r in results for e in r["errors"]]
    assert any("No space left on device" in e for e in errors), errors
    for r in results:
        assert r["ok"][:2] == [0, 1], r  # the first whole snapshot and logged step fit


# -- the rank side -----------------------------------------------------------------------
def _run(rank: int, device, shm) -> dict:
    import torch

    from services.spec import parse_spec
    from worker.snapshots import SnapshotPlan
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.sdc import state_tensors
    from worker.trainer.snapshot import Snapshotter
    from worker.trainer.step import Trainer

    spec = parse_spec(
        {
            "name": "shm-full",
            "model": {"preset": "tiny"},
            "data": {"source": "synthetic", "seed": 7},
            "parallel": {"dp": 2, "zero": 3},
            "train": {"steps": STEPS, "global_batch": 4, "lr": 3e-3, "warmup_steps": 2},
        }
    )
    dims = ParallelDims(spec.parallel, device.type)
    mesh = dims.build_mesh()
    reference = Trainer(spec, RankContext(dims, mesh, rank, device))  # never snapshotted
    t = Trainer(spec, RankContext(dims, mesh, rank, device))
    plan = SnapshotPlan(shm / "job", 1, 1, 2, {0: 1, 1: 0}, full_every=4)
    lines: dict[int, dict] = {}
    snaps = Snapshotter(plan, rank, device, lambda x: lines.update({x["step"]: x}), t.parts)
    parts = (t.parts, t.optimizers, t.schedulers)
    snaps.take(0, *parts, {"step": 0})
    done = 0
    for index in range(STEPS):
        reference.train_step(index)
        t.train_step(index, before_update=lambda s=index + 1: snaps.before_update(s, t.optimizers))
        snaps.take(index + 1, *parts, {"step": index + 1})
        done += 1
    snaps.close()
    pairs = zip(
        state_tensors(t.parts, t.optimizers),
        state_tensors(reference.parts, reference.optimizers),
        strict=True,
    )
    return {
        "scenario": "shm-full",
        "rank": rank,
        "steps": done,
        "ok": [s for s, line in sorted(lines.items()) if line["ok"]],
        "errors": [line["error"] for line in lines.values() if "error" in line],
        "same_as_without_snapshots": all(torch.equal(a, b) for (_, a), (_, b) in pairs),
    }


def _main() -> None:
    import sys
    from pathlib import Path

    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    try:
        print(json.dumps(_run(rank, device, Path(sys.argv[1]))), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
