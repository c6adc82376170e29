"""Chaos inside expert parallelism (issue 17): the trainer of a rank that holds one expert
shard is SIGKILLed mid-run. A spare is promoted into its coordinate, so the same expert shard
(dp % ep) comes back on the spare from its buddy's copy, and the loss curve is bit-identical
to an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import (
    assert_curve,
    at_step,
    completed,
    kill,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.test_chaos import KILL_AT, hot_restore, only_recovery, same_coordinates

pytestmark = pytest.mark.slow


def test_sigkill_an_expert_parallel_rank(stack, uninterrupted):
    spec = mesh_spec("chaos-moe", parallel={"dp": 2, "ep": 2, "tp": 2})  # 4 ranks, 1 spare
    spec["model"] |= {"experts": 4, "top_k": 2}
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    assert j1.mesh.shape.ep == 2
    victim, spare = rank(j1, 2), j1.mesh.spares[0]  # dp 1, tp 0: the second expert shard
    assert victim.coord.ep == 1
    wait_record(metrics_path(stack, j1, 2), at_step(KILL_AT), 120, f"rank 2 at step {KILL_AT}")
    kill(victim.pid)
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "TrainerKilled", "replace")
    assert [(f.rank, f.worker) for f in rec.faults] == [(2, victim.worker)], rec.faults
    assert rec.replaced == [{"old": victim.worker, "new": spare}]
    completed(rec)
    hot_restore(rec, moved=2, world=4)
    same_coordinates(j1, j, {victim.worker: spare})
    assert rank(j, 2).worker == spare and rank(j, 2).coord.ep == 1
    curve = assert_curve(stack, j, want, exact=True)
    # the routing went on as the uninterrupted run's: same tokens per expert after the kill
    assert [curve[s]["experts"] for s in sorted(curve)] == [r["experts"] for r in want]
