"""After a recovery, the agent drops the snapshots of the generation the new one restored
from as soon as every rank of its worker has finished a step of the new one (worker/agent/
agent.py, `_drop_restored`), rather than at the next recovery: host memory then holds one
generation's rings, which is what admission budgets (services/planner/snapshot_memory.py).
rank 1 of a paced dp2 job is SIGKILLed; while generation 2 still trains, every one of its
workers holds the job's snapshots of generation 2 alone, and the job ends with the
uninterrupted run's losses, bit for bit."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import (
    assert_curve,
    at_step,
    kill,
    metrics_path,
    paced_spec,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.stack import TERMINAL, wait_until

pytestmark = pytest.mark.slow


def test_the_restored_generations_snapshots_go_once_every_rank_stepped(stack, uninterrupted):
    spec = paced_spec("chaos-drop-restored")
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    wait_record(metrics_path(stack, j1, 1), at_step(5), 120, "rank 1 at step 5")
    kill(rank(j1, 1).pid)
    j2 = w.until(
        lambda j: j.generation == 2 and all(r.pid for r in j.mesh.ranks), 120, "generation 2"
    )
    for n in range(len(j2.mesh.ranks)):
        wait_record(metrics_path(stack, j2, n), at_step(1), 120, f"rank {n}'s first step in g2")
    workers = {r.worker for r in j2.mesh.ranks}

    def generations() -> dict[str, list[str]]:
        return {
            wid: sorted(p.name for p in stack.snapshot_dir(wid, j1.id).glob("g*"))
            for wid in workers
        }

    wait_until(
        lambda: all(gens == ["g2"] for gens in generations().values()),
        10,
        f"generation 1's snapshots to go: {generations()}",
        every=0.05,
    )
    assert w.poll().phase not in TERMINAL  # dropped while the job trains, not at its end
    j = w.finish()
    succeeded(stack, j)
    assert [r.cause for r in j.recoveries] == ["TrainerKilled"], j.recoveries
    assert set(j.recoveries[0].restored_from.values()) <= {"memory", "peer"}
    assert_curve(stack, j, want, exact=True)
