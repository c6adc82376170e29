"""The queue's order rule (docs/control-plane.md, "Scheduling"): a job that cannot start now
never blocks later ones (backfill), unless it fits the pool and has waited `reserve_after_s`
(then it has first claim on freed workers); per-owner quotas make a job wait, not fail.

Real redis-server and the real `Scheduler`, driven pass by pass as the controller's loop does;
the agents' side is written into Redis the way the controller's join and the agents write it
(as tests/integration/test_scheduler_race.py does)."""

from __future__ import annotations

import pytest

from controller.admission import Quotas
from controller.jobs import Job, submit
from controller.scheduler import Scheduler, SchedulerConfig
from services.spec import parse_spec
from services.store import Store
from services.tokens import new_token


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="bf:")
    yield s
    s.close()


def join(store: Store, *wids: str) -> None:
    """What the controller writes when agents join (1 CPU device, 8 GiB), plus a heartbeat."""
    for wid in wids:
        store.join_worker(
            wid,
            {
                "host": "h1",
                "address": "127.0.0.1",
                "labels": {"host": "h1"},
                "devices": 1,
                "state": "idle",
                "memory_bytes": 8 * 2**30,
                "device_kind": "cpu",
            },
            new_token(),
        )
        store.heartbeat(wid)


def beat(store: Store, *wids: str) -> None:
    for wid in wids:
        store.heartbeat(wid)


def job_of(store: Store, name: str, owner: str = "alice", dp: int = 1) -> str:
    spec = parse_spec(
        {
            "name": name,
            "model": {"preset": "tiny"},
            "parallel": {"dp": dp},
            "train": {"steps": 100, "global_batch": 12},
        }
    )
    return submit(store, spec, owner)[0]


def running(store: Store, jid: str) -> dict:
    return Job.from_hash(jid, store.job(jid)).condition("Running")


def holders(store: Store) -> dict[str, str]:
    """worker -> job for every worker the scheduler handed out."""
    out = {}
    for wid in ("w1", "w2", "w3"):
        ptr = store.worker_assignment(wid)
        if ptr.get("job"):
            out[wid] = ptr["job"]
    return out


def scheduler(store: Store, **cfg) -> tuple[Scheduler, str]:
    return Scheduler(store, SchedulerConfig(worker_alive_s=30, **cfg), "ctl"), store.acquire_lease(
        "ctl", 60
    )


def test_a_job_that_can_never_fit_does_not_block_a_smaller_one(store):
    """dp=4 on 2 workers (the pool shrank after admission, or Redis was written directly):
    the 1-rank job submitted after it starts in the same pass."""
    join(store, "w1", "w2")
    sched, lease = scheduler(store)
    big = job_of(store, "big", dp=4)
    small = job_of(store, "small")
    sched.run_once(lease)
    assert holders(store) == {"w1": small}
    waiting = running(store, big)
    assert waiting["reason"] == "WaitingForCapacity"
    assert "more than the live pool holds" in waiting["message"], waiting["message"]
    assert running(store, small)["status"] == "True"


def test_a_big_job_that_fits_is_backfilled_past_then_reserves(store):
    """Three workers, one held by a running job. A 3-rank job waits; a 1-rank job behind it
    backfills onto a free worker. Once the big job has waited reserve_after_s, a later small job
    no longer backfills, so the freed workers go to the big job, not to a stream of small ones."""
    join(store, "w1", "w2", "w3")
    sched, lease = scheduler(store, reserve_after_s=3600)
    first = job_of(store, "first")
    sched.run_once(lease)
    assert holders(store) == {"w1": first}
    big, small = job_of(store, "big", dp=3), job_of(store, "small")
    sched.run_once(lease)
    assert holders(store) == {"w1": first, "w2": small}, "the small job must backfill"
    assert running(store, big)["reason"] == "WaitingForCapacity"

    # the same queue, with the bound reached: the big job reserves, a later small job waits
    sched, lease = scheduler(store, reserve_after_s=0)
    late = job_of(store, "late")
    beat(store, "w1", "w2", "w3")
    sched.run_once(lease)
    assert holders(store) == {"w1": first, "w2": small}, "the late job must not take w3"
    msg = running(store, late)["message"]
    assert (
        running(store, late)["reason"] == "WaitingForCapacity" and f"queued behind job {big}" in msg
    ), msg


def test_an_unplaceable_job_never_reserves(store):
    """Even after waiting past the bound, a job larger than the whole pool reserves nothing."""
    join(store, "w1", "w2")
    sched, lease = scheduler(store, reserve_after_s=0)
    huge = job_of(store, "huge", dp=4)
    small = job_of(store, "small")
    sched.run_once(lease)
    assert holders(store) == {"w1": small}
    assert running(store, huge)["reason"] == "WaitingForCapacity"


def test_owner_over_quota_waits_without_blocking_others(store):
    join(store, "w1", "w2", "w3")
    sched, lease = scheduler(store, quotas=Quotas(default=None, owners={"alice": 1}))
    a1 = job_of(store, "a1", owner="alice")
    a2 = job_of(store, "a2", owner="alice")
    b1 = job_of(store, "b1", owner="bob")
    sched.run_once(lease)
    assert holders(store) == {"w1": a1, "w2": b1}
    cond = running(store, a2)
    assert cond["reason"] == "WaitingForQuota", cond
    assert "alice runs 1 of its quota of 1" in cond["message"], cond["message"]
    reasons = [e["reason"] for e in store.events(a2)]
    assert reasons.count("WaitingForQuota") == 1
    sched.run_once(lease)  # still waiting: no second event, and w3 stays free
    assert holders(store) == {"w1": a1, "w2": b1}
    assert [e["reason"] for e in store.events(a2)].count("WaitingForQuota") == 1
