"""Hot recovery (docs/architecture.md, "Hot recovery"): a job killed again and again restores
each time from host memory, redoes at most one step per kill, and ends with the very loss
curve of an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import (
    assert_curve,
    completed,
    kill,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.test_chaos import hot_restore

pytestmark = pytest.mark.slow

KILLS = 5
# Each generation trains a step or few before its kill (the fifth came at step 16 of 60 under
# load; at most 4 steps a generation seen): 30 leaves the last generation steps to train.
STEPS = 30


def test_five_kills_each_redo_at_most_one_step_and_the_loss_is_bit_identical(stack, uninterrupted):
    spec = mesh_spec("hot-five-kills", steps=STEPS, parallel={"dp": 2})
    want = uninterrupted(spec)
    w, j = start(stack, spec)
    for n in range(KILLS):
        gen = j.mesh.generation
        # Kill only once rank 1's buddy (rank 0) holds a copy taken in this generation: every
        # snapshot line of this generation's file comes after its restore.
        wait_record(
            metrics_path(stack, j, 0),
            lambda r: r.get("event") == "snapshot" and "1" in r.get("held", {}),
            120,
            f"rank 0 to hold a copy of rank 1 in generation {gen}",
        )
        kill(rank(j, 1).pid)
        # the next kill only once this recovery is closed: a restore from memory is fast
        # enough for a kill to beat the controller's sight of the first step
        j = w.until(
            lambda j, gen=gen, n=n: (
                j.mesh.generation == gen + 1
                and all(r.state == "running" and r.pid for r in j.mesh.ranks)
                and len(j.recoveries) == n + 1
                and j.recoveries[-1].completed_at is not None
            ),
            120,
            f"generation {gen + 1} to train after kill {n + 1}",
        )
    j = w.finish()
    succeeded(stack, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [("TrainerKilled", "replace")] * KILLS
    for rec in j.recoveries:
        completed(rec)
        hot_restore(rec, moved=1, world=2)
    assert_curve(stack, j, want, exact=True)
