"""What writing a generation costs (controller/apply.py `start_generation`), on a real Redis
through the real next-generation layout: a recovery that swaps one worker writes the
pointers of the two workers it swaps, not every worker's, and of the assignment the moved
rank's entry and the header, not every rank's; it announces the generation once, on the
job's assignment channel; a kept worker reads the new generation through its unchanged
pointer, and its heartbeat says its old one is superseded (issue 48)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.apply import start_generation
from controller.recovery import Layout, replace_workers
from services.assignment import Assignment
from services.mesh import MeshShape
from services.store import Store, Tx
from tests.unit.test_preempting import job, make_pass
from tests.unit.test_recovery import free, mesh

SHAPE = MeshShape(4, 1, 1)  # w0..w3, one rank each, and the job's spare s0


@pytest.fixture
def ctx(redis_server):
    return make_pass(Store(redis_server.url))


def written(tx: Tx, verb: str, keys: list[str]) -> list[str]:
    """The keys of `keys` that `tx` sends `verb` to, in order."""
    return [c[1] for c in tx.cmds if c[0] == verb and c[1] in keys]


def test_a_recovery_writes_the_pointers_it_changes_and_announces_the_generation_once(ctx):
    k, j = ctx.keys, job("j", "default", 4, 1)
    j.generation = 0  # not placed yet
    ranks, host_of = mesh(SHAPE, ["h0", "h1", "h2", "h3"])
    tx = Tx()
    g1 = start_generation(ctx, j, Layout(SHAPE, ranks, 1, {}, ["s0"]), None, "Starting", tx)
    ctx.commit(tx)
    pointers = [k.worker_assignment(w) for w in ("w0", "w1", "w2", "w3", "s0")]
    assert written(tx, "HSET", pointers) == pointers  # a placement writes every one
    assert ctx.store.worker_assignment("s0") == {"job": "j", "role": "spare", "generation": "1"}

    # w2 fails; the job's spare s0 takes its rank
    lay = replace_workers(g1.shape, g1.ranks, 1, {"w2"}, free("s0@h9"), [], host_of)
    tx = Tx()
    g2 = start_generation(ctx, j, lay, g1, "Recovering", tx)
    ctx.commit(tx)
    assert [r.wid for r in g2.ranks] == ["w0", "w1", "s0", "w3"]
    assert written(tx, "HSET", pointers) == [k.worker_assignment("s0")]  # now a rank
    assert written(tx, "DELIFEQ", pointers) == [k.worker_assignment("w2")]  # released
    ranks_written = [
        f for c in tx.cmds if c[:2] == ["HSET", k.job_assignment("j")] for f in c[2::2]
    ]
    assert [f for f in ranks_written if f.startswith("rank:")] == ["rank:2"]
    assert Assignment.from_fields(ctx.store.job_assignment("j")) == g2  # whole, as agents read
    announced = [c for c in tx.cmds if c[0] == "PUBLISH" and c[1] == k.job_assignment("j")]
    assert announced == [["PUBLISH", k.job_assignment("j"), "2"]]

    # what a kept worker's agent reads: the same pointer, the new generation
    assert ctx.store.worker_assignment("w0") == {"job": "j", "role": "rank", "generation": "2"}
    beat = ctx.store.heartbeat("w0", "j", 1)
    assert (beat.job, beat.generation) == ("j", 2)  # generation 1 is superseded
    assert ctx.store.worker_assignment("s0")["role"] == "rank"
    assert ctx.store.worker_assignment("w2") == {}


def test_a_field_a_new_generation_drops_is_deleted_from_the_stored_assignment(ctx):
    k, j = ctx.keys, job("j", "default", 4, 1)
    ranks, _ = mesh(SHAPE, ["h0", "h1", "h2", "h3"])
    old = Assignment("j", 1, SHAPE, "10.0.0.1", 20001, ranks, microbatches=4, dp_labels=[1, 0])
    ctx.commit(Tx().hset(k.job_assignment("j"), old.to_fields()))
    j.generation = 1
    # the same shape, rank 3 moved, back to the spec's microbatches and labels
    new = replace(
        old,
        generation=2,
        ranks=[*ranks[:3], replace(ranks[3], wid="s0")],
        microbatches=None,
        dp_labels=None,
    )
    fields, cleared = new.changes_from(old)
    assert sorted(cleared) == ["buddies", "dp_labels", "microbatches", "restore", "store"]
    assert [f for f in fields if f.startswith("rank:")] == ["rank:3"]
    ctx.commit(Tx().hset(k.job_assignment("j"), fields).hdel(k.job_assignment("j"), *cleared))
    stored = ctx.store.job_assignment("j")
    assert "microbatches" not in stored and "dp_labels" not in stored
    assert Assignment.from_fields(stored) == new
