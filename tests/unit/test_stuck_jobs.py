"""A job the pass cannot handle costs that job alone (docs/security.md, "Poisoned state"), on a
real Redis and the real scheduler: it is skipped while the others are handled, counted once,
and failed with the error as its reason once it has failed for `fail_stuck_after_s`; a record
that does not parse leaves the queue and releases the workers its assignment names.

The failure is injected into one job's handling: no credential but the admin's can write a
job record (tests/security/test_agents_redis.py), so what is tested is the containment of
whatever a bug or a hand edit would raise."""

from __future__ import annotations

import time

import pytest

from controller.jobs import Job
from controller.passes import SchedulerConfig
from controller.scheduler import Scheduler
from services.assignment import Assignment, Coord, RankEntry
from services.mesh import MeshShape
from services.spec import parse_spec
from services.store import Store, flat
from tests.stack import tiny_spec

BOUND_S = 0.5


@pytest.fixture
def store(redis_server) -> Store:
    s = Store(redis_server.url)
    yield s
    s.close()


def submit(store: Store, jid: str) -> None:
    spec = parse_spec(tiny_spec(jid, parallel={"dp": 1}))
    job = Job(id=jid, name=jid, spec=spec, submitted_at=store.now())
    job.set("Running", False, "Queued", "waiting for the scheduler", store.now())
    store.create_job(jid, {"spec": spec.model_dump(mode="json"), **job.fields()})


def job(store: Store, jid: str) -> Job:
    return Job.from_hash(jid, store.job(jid))


@pytest.fixture
def scheduler(store) -> Scheduler:
    """The scheduler, with `broken`'s handling raising what a bug would."""
    s = Scheduler(store, SchedulerConfig(fail_stuck_after_s=BOUND_S), "test")
    handle = s._handle

    def broken_for_one(ctx, jid, *rest):
        if jid == "broken":
            raise KeyError("'grow_after'")
        return handle(ctx, jid, *rest)

    s._handle = broken_for_one
    return s


def test_a_job_whose_handling_raises_is_skipped_then_failed_and_the_others_go_on(store, scheduler):
    lease = store.acquire_lease("test", 30.0)
    submit(store, "broken")
    submit(store, "bystander")
    scheduler.run_once(lease)
    assert job(store, "broken").phase == "Pending"  # skipped, not failed at once
    assert store.state_errors["job"] == 1
    store.request_cancel("bystander")
    scheduler.run_once(lease)  # the bystander's cancel lands while "broken" is skipped
    assert job(store, "bystander").phase == "Cancelled"
    assert job(store, "broken").phase == "Pending"
    assert store.state_errors["job"] == 1  # once, not once a pass
    time.sleep(BOUND_S)
    scheduler.run_once(lease)
    broken = job(store, "broken")
    assert broken.phase == "Failed"
    failed = broken.condition("Failed")
    assert failed["reason"] == "ControllerError", failed
    assert "KeyError" in failed["message"] and "grow_after" in failed["message"], failed
    assert "broken" not in store.job_ids(open_only=True)
    assert store.state_errors["job"] == 1


def test_a_job_that_recovers_before_the_bound_is_not_failed(store, scheduler):
    lease = store.acquire_lease("test", 30.0)
    submit(store, "broken")
    scheduler.run_once(lease)
    handle = scheduler._handle
    scheduler._handle = lambda ctx, jid, *rest: Scheduler._handle(scheduler, ctx, jid, *rest)
    scheduler.run_once(lease)  # handled: its clock is reset
    scheduler._handle = handle
    time.sleep(BOUND_S)
    scheduler.run_once(lease)  # failing again, but only since now
    assert job(store, "broken").phase == "Pending"


def test_a_record_that_does_not_parse_leaves_the_queue_and_frees_its_workers(store):
    """Degrees that are not numbers: the API answers 404 for such a record, and the pass
    drops it and releases the worker its assignment names."""
    lease = store.acquire_lease("test", 30.0)
    submit(store, "garbled")
    entries = [RankEntry(0, "w0", 0, Coord(0, 0, 0))]
    asg = Assignment("garbled", 1, MeshShape(1, 1, 1), "127.0.0.1", 20001, entries)
    store.r.hset(store.keys.job_assignment("garbled"), mapping=flat(asg.to_fields()))
    store.r.hset(store.keys.worker_assignment("w0"), mapping={"job": "garbled", "role": "rank"})
    store.r.hset(store.keys.job("garbled"), "current", '{"dp": "x"}')
    assert job(store, "garbled") is None
    Scheduler(store, SchedulerConfig(), "test").run_once(lease)
    assert "garbled" not in store.job_ids(open_only=True)
    assert store.worker_assignment("w0") == {}
