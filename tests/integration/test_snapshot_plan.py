"""The controller's side of hot recovery (controller/apply.py, services/buddies.py): every
generation it writes names each rank's snapshot holder, and a recovery that keeps the mesh
names where each rank's state lives (docs/architecture.md, "Hot recovery").

Real redis-server and a real `Scheduler`; the agents' side is written into Redis the way the
agent writes it (as in test_scheduler_race.py)."""

from __future__ import annotations

import pytest

from controller.jobs import submit
from controller.scheduler import Scheduler, SchedulerConfig
from services.assignment import Assignment
from services.spec import parse_spec
from services.store import Store
from services.tokens import new_token


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="snap:")
    yield s
    s.close()


@pytest.fixture
def scheduler(store):
    return Scheduler(store, SchedulerConfig(worker_alive_s=30), "ctl")


def agent_up(store: Store, wid: str, state: str = "idle") -> None:
    """A joined agent on a host of its own, with a fresh heartbeat."""
    host = f"host-{wid}"
    store.join_worker(
        wid,
        {
            "host": host,
            "address": "127.0.0.1",
            "labels": {"host": host},
            "devices": 1,
            "state": state,
        },
        new_token(),
    )
    store.heartbeat(wid)


def rank_exited(store: Store, wid: str, jid: str, rank: int, code: int) -> None:
    """The agent's report after its trainer exited with `code` (negative: a signal)."""
    store.write_progress(
        wid,
        {
            "job": jid,
            "generation": 1,
            "state": "failed",
            "ranks": {str(rank): {"state": "failed", "exit_code": code, "exited_at": store.now()}},
        },
    )


def start_dp2(store: Store, scheduler: Scheduler, lease: str, **snapshot) -> tuple[str, list]:
    """A dp-2 job with one spare on three one-worker hosts, placed: its id and its ranks."""
    spec = {
        "name": "snap",
        "model": {"preset": "tiny"},
        "parallel": {"dp": 2},
        "train": {"steps": 100, "global_batch": 4},
        "fault_tolerance": {"spares": 1},
        "snapshot": snapshot,
    }
    jid = submit(store, parse_spec(spec), owner="tester")[0]
    for wid in ("w1", "w2", "w3"):
        agent_up(store, wid)
    scheduler.run_once(lease)
    for wid in ("w1", "w2", "w3"):
        agent_up(store, wid, state="busy")
    return jid, assignment(store, jid).ranks


def assignment(store: Store, jid: str) -> Assignment:
    asg = Assignment.from_fields(store.job_assignment(jid))
    assert asg is not None
    return asg


def test_a_replacement_restores_the_moved_rank_from_its_buddy(store, scheduler):
    lease = store.acquire_lease("ctl", ttl_s=60)
    jid, ranks = start_dp2(store, scheduler, lease)
    first = assignment(store, jid)
    # each rank's copy on the other replica's host; a first placement restores from disk
    assert (first.buddies, first.restore_sources) == ({0: 1, 1: 0}, None)

    rank_exited(store, ranks[1].wid, jid, 1, -9)  # SIGKILL: rank 1 moves to the spare
    scheduler.run_once(lease)
    second = assignment(store, jid)
    assert second.generation == 2 and second.ranks[1].wid != ranks[1].wid
    assert (second.restore_generation, second.restore_sources) == (1, {0: 0, 1: 0})
    assert second.buddies == {0: 1, 1: 0}


def test_without_buddies_a_restart_in_place_restores_from_memory(store, scheduler):
    lease = store.acquire_lease("ctl", ttl_s=60)
    jid, ranks = start_dp2(store, scheduler, lease, buddy=False)
    assert assignment(store, jid).buddies == {}
    for r in ranks:  # every rank fails with an error, no root cause: a restart in place
        rank_exited(store, r.wid, jid, r.rank, 1)
    for r in ranks:
        store.heartbeat(r.wid)  # alive after the exits: nothing is dead
    scheduler.run_once(lease)
    second = assignment(store, jid)
    assert [r.wid for r in second.ranks] == [r.wid for r in ranks]
    assert (second.restore_generation, second.restore_sources, second.buddies) == (
        1,
        {0: 0, 1: 1},
        {},
    )


def test_without_buddies_a_moved_rank_sends_the_world_to_disk(store, scheduler):
    lease = store.acquire_lease("ctl", ttl_s=60)
    jid, ranks = start_dp2(store, scheduler, lease, buddy=False)
    rank_exited(store, ranks[1].wid, jid, 1, -9)
    scheduler.run_once(lease)
    second = assignment(store, jid)
    assert second.generation == 2 and second.restore_sources is None


def test_with_snapshots_off_no_holder_and_no_source_is_written(store, scheduler):
    lease = store.acquire_lease("ctl", ttl_s=60)
    jid, ranks = start_dp2(store, scheduler, lease, enabled=False)
    for r in ranks:
        rank_exited(store, r.wid, jid, r.rank, 1)
    for r in ranks:
        store.heartbeat(r.wid)
    scheduler.run_once(lease)
    second = assignment(store, jid)
    assert second.generation == 2
    assert (second.buddies, second.restore_sources) == ({}, None)
