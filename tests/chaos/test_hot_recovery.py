"""Hot recovery (docs/architecture.md, "Hot recovery"): a job killed again and again restores
each time from host memory, redoes at most one step per kill, and ends with the very loss
curve of an uninterrupted run; a job that loses a whole host, memory and all, restores the
lost rank from the copy on its buddy's host."""

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
from tests.chaos.test_chaos import KILL_AT, hot_restore, only_recovery, same_coordinates
from tests.stack import Stack

pytestmark = pytest.mark.slow

KILLS = 5
# Each generation trains a step or few before its kill (the fifth came at step 16 of 60 under
# load; at most 4 steps a generation seen): 30 leaves the last generation steps to train.
STEPS = 30


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """A dp2 job's two workers and its spare, each on a host of its own: its own host name,
    and memory of its own that dies with it (tests/stack.py, `kill_host`)."""
    s = Stack(tmp_path_factory.mktemp("hosts"), workers=3, hosts=True)
    yield s
    s.close()


def test_five_kills_each_redo_at_most_one_step_and_the_loss_is_bit_identical(stack, uninterrupted):
    spec = mesh_spec("hot-five-kills", steps=STEPS, parallel={"dp": 2})
    want = uninterrupted(spec)
    w, j = start(stack, spec)
    for n in range(KILLS):
        gen = j.mesh.generation
        # Kill only once rank 1's buddy (rank 0) holds a copy taken in this generation: every
        # snapshot line of this generation's file comes after its restore.
        held = wait_record(
            metrics_path(stack, j, 0),
            lambda r: r.get("event") == "snapshot" and "1" in r.get("held", {}),
            120,
            f"rank 0 to hold a copy of rank 1 in generation {gen}",
        )
        # the shared stack's workers share this host's memory: the copy is a link to rank
        # 1's own file, which outlives rank 1's worker directory
        assert held["held_via"] == {"1": "link"}, held
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


def test_whole_host_loss_restores_the_rank_from_its_buddys_host(hosts, uninterrupted):
    # Every snapshot after the first (at step 0; this FSDP layout has no replicas to check,
    # so no snapshot is taken whole for a check) a logged step: the rank's restore replays
    # every step since, sent over the network.
    spec = mesh_spec("host-loss", steps=STEPS, parallel={"dp": 2}) | {
        "snapshot": {"full_every": 64}
    }
    want = uninterrupted(spec)
    w, j1 = start(hosts, spec)
    victim, spare = rank(j1, 1), j1.mesh.spares[0]
    # rank 1's copy lives on rank 0's host, and got there over the network: no host can read
    # another's memory
    held = wait_record(
        metrics_path(hosts, j1, 0),
        lambda r: r.get("event") == "snapshot" and "1" in r.get("held", {}),
        120,
        "rank 0 to hold a copy of rank 1",
    )
    assert held["held_via"] == {"1": "network"}, held
    wait_record(metrics_path(hosts, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    killed = hosts.kill_host(victim.worker)  # the agent, its zygote, its trainers: its memory
    assert gone(victim.pid), (victim.pid, killed)
    j = w.finish()
    succeeded(hosts, j)
    rec = only_recovery(j, "WorkerDead", "replace")
    assert rec.replaced == [{"old": victim.worker, "new": spare}]
    completed(rec)
    hot_restore(rec, moved=1, world=2)
    same_coordinates(j1, j, {victim.worker: spare})
    # the spare's host could not read the copy either: the holder sent it
    restored = wait_record(
        metrics_path(hosts, j, 1), lambda r: r.get("event") == "restored", 10, "rank 1 restored"
    )
    assert (restored["source"], restored["via"]) == ("peer", "network"), restored
    assert restored["replayed"] == restored["step"] > 0, restored
    assert_curve(hosts, j, want, exact=True)
