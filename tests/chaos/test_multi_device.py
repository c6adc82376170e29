"""One agent per node, holding several ranks (`--devices 4`), as on a GPU node: a killed
trainer restarts its ranks in place and every rank restores from host memory
(docs/architecture.md, "Failure handling"); a lost node's ranks move whole to another node
and restore from the copies their buddies hold on the surviving one."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import (
    assert_curve,
    at_step,
    completed,
    gone,
    kill,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.test_chaos import KILL_AT
from tests.stack import Stack

pytestmark = pytest.mark.slow

DEVICES = 4


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One agent holding 4 ranks: a dp2 x tp2 job fills it, and no other worker has room."""
    s = Stack(tmp_path_factory.mktemp("node"), workers=1, devices=DEVICES)
    yield s
    s.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Three 4-rank agents, each a host of its own with memory of its own: a dp2 x pp2 x tp2
    job fills two, one replica each, and the third is its spare."""
    s = Stack(tmp_path_factory.mktemp("nodes"), workers=3, devices=DEVICES, hosts=True)
    yield s
    s.close()


def killed_in_place(stack: Stack, w, j1, victim: int):
    """SIGKILL rank `victim`'s trainer mid-run; the job once that recovery completed: a
    `restart` with no worker moved or quarantined, every rank (the killed one too: its
    snapshot outlives its process) restored from its own host memory, at most one step
    redone."""
    wait_record(metrics_path(stack, j1, victim), at_step(KILL_AT), 120, f"rank {victim} trains")
    killed = rank(j1, victim)
    kill(killed.pid)
    j = w.until(
        lambda j: j.recoveries and j.recoveries[0].completed_at is not None,
        120,
        "the recovery from the kill to complete",
    )
    rec = j.recoveries[0]
    assert (rec.cause, rec.action) == ("TrainerKilled", "restart"), rec
    assert [(f.rank, f.worker) for f in rec.faults] == [(victim, killed.worker)], rec.faults
    assert rec.replaced == [] and not rec.quarantined, rec
    completed(rec)
    world = len(j1.mesh.ranks)
    assert rec.restored_from == {str(r): "memory" for r in range(world)}, rec
    assert {(r.rank, r.worker) for r in j.mesh.ranks} == {(r.rank, r.worker) for r in j1.mesh.ranks}
    assert gone(killed.pid)
    return j


def test_killed_rank_on_a_one_node_job_restarts_in_place_from_memory(node, uninterrupted):
    spec = mesh_spec("node-kill", parallel={"dp": 2, "tp": 2}, spares=0)
    want = uninterrupted(spec)
    w, j1 = start(node, spec)
    killed_in_place(node, w, j1, victim=1)
    j = w.finish()
    succeeded(node, j)
    assert len(j.recoveries) == 1, j.recoveries
    assert_curve(node, j, want, exact=True)


def test_two_node_job_restarts_a_killed_rank_in_place_and_restores_a_lost_node_from_the_other(
    nodes, uninterrupted
):
    """dp2 x pp2 x tp2, one replica per node: a killed trainer restarts in place; then the
    whole node of replica 1 dies, its four ranks move together to the spare node, and each
    restores from the copy its buddy on replica 0's node holds (sent over the network: no
    node reads another's memory). The loss curve is an uninterrupted run's, bit for bit."""
    spec = mesh_spec("nodes", steps=20, parallel={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2})
    want = uninterrupted(spec)
    w, j1 = start(nodes, spec)
    lost = rank(j1, 4).worker
    on_lost = sorted(r.rank for r in j1.mesh.ranks if r.worker == lost)
    assert on_lost == [4, 5, 6, 7], j1.mesh.ranks
    spare = j1.mesh.spares[0]
    j2 = killed_in_place(nodes, w, j1, victim=5)
    held = wait_record(
        metrics_path(nodes, j2, 0),
        lambda r: r.get("event") == "snapshot" and "4" in r.get("held", {}),
        120,
        "rank 0 to hold a copy of rank 4 in generation 2",
    )
    assert held["held_via"] == {"4": "network"}, held
    nodes.kill_host(lost)
    j = w.finish()
    succeeded(nodes, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [
        ("TrainerKilled", "restart"),
        ("WorkerDead", "replace"),
    ], j.recoveries
    rec = j.recoveries[1]
    assert rec.replaced == [{"old": lost, "new": spare}], rec
    completed(rec)
    assert rec.restored_from == {str(r): "peer" if r in on_lost else "memory" for r in range(8)}
    assert_curve(nodes, j, want, exact=True)
