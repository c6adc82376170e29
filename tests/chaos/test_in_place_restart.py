"""Healthy ranks keep their processes across a recovery (issue 48, worker/trainer/handoff.py):
a dp4 x tp2 job on two 4-rank agents loses one rank to SIGKILL; every other rank's trainer
takes the next generation in its own process (same pid), the killed slot gets a new one, and
the loss curve is an uninterrupted run's, bit for bit."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import assert_curve, events, mesh_spec, start, succeeded
from tests.chaos.test_multi_device import killed_in_place
from tests.stack import Stack

pytestmark = pytest.mark.slow

WAIT_S = 300  # 8 trainers beside two agents and their zygotes on a 2-core host


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("inplace"), workers=2, devices=4)
    yield s
    s.close()


def test_a_kill_keeps_every_other_ranks_process_and_the_exact_curve(two_nodes, uninterrupted):
    spec = mesh_spec("in-place", parallel={"dp": 4, "tp": 2}, spares=0)
    want = uninterrupted(spec)
    w, j1 = start(two_nodes, spec)
    # both agents follow the job's generations on its assignment channel (without it, only a
    # heartbeat's answer or the periodic re-read would tell them, later)
    channel = two_nodes.store.keys.job_assignment(j1.id)
    assert two_nodes.store.r.pubsub_numsub(channel) == [(channel, 2)]
    before = {r.rank: r.pid for r in j1.mesh.ranks}
    victim = 5  # replica 2's second TP rank: its replica's peer and three replicas survive
    j2 = killed_in_place(two_nodes, w, j1, victim)  # a restart, every rank from memory
    after = {r.rank: r.pid for r in j2.mesh.ranks}
    assert {r: after[r] for r in before if r != victim} == {
        r: pid for r, pid in before.items() if r != victim
    }, (before, after)
    assert after[victim] != before[victim], (before, after)
    kept = [e for e in events(two_nodes, j1.id) if e.reason == "TrainerKept"]
    assert len(kept) == 2, [(e.reason, e.message) for e in events(two_nodes, j1.id)]
    j = w.finish(timeout=2 * WAIT_S)
    succeeded(two_nodes, j)
    assert len(j.recoveries) == 1, j.recoveries
    assert_curve(two_nodes, j, want, exact=True)
