"""Where a generation rendezvouses (controller/apply.py `job_store`), through the real
next-generation layouts of controller/recovery.py, on a real Redis: a recovery keeps the
job's store (address, port, host) while its worker still runs ranks; the store moves to the
new rank 0's worker, on a fresh port, when its worker left or after STORE_GENERATIONS. Stored
with the assignment and read back."""

from __future__ import annotations

import pytest

from controller.apply import STORE_GENERATIONS, job_store
from controller.recovery import Layout, replace_workers
from services.assignment import Assignment
from services.mesh import MeshShape
from services.store import Store
from tests.unit.test_assignment import stored
from tests.unit.test_preempting import make_pass
from tests.unit.test_recovery import free, mesh

SHAPE = MeshShape(2, 1, 2)  # w0..w3, one rank each: replicas (w0 w1) (w2 w3)
INFOS = {f"w{i}": {"address": f"10.0.0.{i + 1}"} for i in range(4)} | {
    "s0": {"address": "10.0.0.9"}
}


@pytest.fixture
def ctx(redis_server):
    return make_pass(Store(redis_server.url))


def generation(ctx, gen: int, layout: Layout, old: Assignment | None) -> Assignment:
    addr, port, wid, since = job_store(ctx, layout, old, gen, INFOS)
    asg = Assignment(
        "j", gen, layout.shape, addr, port, layout.ranks, store_wid=wid, store_since=since
    )
    return Assignment.from_fields(stored(asg))  # as the agents read it


def first(ctx) -> tuple[Assignment, dict[str, str]]:
    ranks, host_of = mesh(SHAPE, [f"h{i}" for i in range(4)])
    return generation(ctx, 1, Layout(SHAPE, ranks, 1, {}, []), None), host_of


def test_a_first_generation_stores_on_rank_0s_worker_in_its_own_key_space(ctx):
    g1, _ = first(ctx)
    assert (g1.master_addr, g1.store_wid, g1.store_since) == ("10.0.0.1", "w0", 1)
    lo, hi = ctx.cfg.rdzv_ports
    assert lo <= g1.master_port < hi
    assert g1.store_space == "meshkeeper/g1"


def test_a_recovery_that_replaces_rank_0_keeps_the_store_its_agent_hosts(ctx):
    g1, host_of = first(ctx)
    # rank 0's trainer died, its agent stays: the same workers, the same store
    g2 = generation(ctx, 2, Layout(SHAPE, g1.ranks, 1, {}, []), g1)
    assert (g2.master_addr, g2.master_port, g2.store_wid, g2.store_since) == (
        g1.master_addr,
        g1.master_port,
        "w0",
        1,
    )
    assert g2.store_space == "meshkeeper/g2"  # the new generation's keys are its own
    # another worker (w3) replaced by a spare: still w0's store
    lay = replace_workers(g2.shape, g2.ranks, 1, {"w3"}, free("s0@h9"), [], host_of)
    g3 = generation(ctx, 3, lay, g2)
    assert (g3.master_port, g3.store_wid) == (g1.master_port, "w0")


def test_the_store_moves_when_its_worker_leaves(ctx):
    g1, host_of = first(ctx)
    lay = replace_workers(g1.shape, g1.ranks, 1, {"w0"}, free("s0@h9"), [], host_of)
    g2 = generation(ctx, 2, lay, g1)
    assert (g2.master_addr, g2.store_wid, g2.store_since) == ("10.0.0.9", "s0", 2)


def test_a_store_serves_at_most_store_generations_generations(ctx):
    g, _ = first(ctx)
    for gen in range(2, STORE_GENERATIONS + 1):
        g = generation(ctx, gen, Layout(SHAPE, g.ranks, 1, {}, []), g)
        assert g.store_since == 1, gen
    g = generation(ctx, STORE_GENERATIONS + 1, Layout(SHAPE, g.ranks, 1, {}, []), g)
    assert (g.store_wid, g.store_since) == ("w0", STORE_GENERATIONS + 1)


def test_an_old_assignment_without_a_store_gets_one(ctx):
    ranks, _ = mesh(SHAPE, [f"h{i}" for i in range(4)])
    old = Assignment.from_fields(stored(Assignment("j", 1, SHAPE, "10.0.0.1", 20001, ranks)))
    assert old.store_wid is None and old.store_space is None
    g2 = generation(ctx, 2, Layout(SHAPE, ranks, 1, {}, []), old)
    assert (g2.store_wid, g2.store_since) == ("w0", 2)
