"""Choosing victims (controller/preempting.py), on a real Redis with a busy pool of six:
fewest ranks first, then the lowest value, then the newest; never a job of equal or higher
value; nothing touched when even every candidate would not make the job fit; and a job
whose victims yielded but whose freed workers another job took chooses again instead of
waiting behind them."""

from __future__ import annotations

import pytest

from controller.jobs import Job
from controller.passes import FreePool, Pass, SchedulerConfig
from controller.placement import FreeWorker
from controller.preempting import try_preempt
from services.assignment import Assignment, Coord, RankEntry
from services.mesh import MeshShape
from services.spec import parse_spec
from services.store import Store, flat
from tests.stack import tiny_spec

POOL = [f"w{n}" for n in range(6)]


@pytest.fixture
def store(redis_server) -> Store:
    store = Store(redis_server.url)
    for wid in POOL:
        store.register_worker(wid, {"joined_at": 1.0, "devices": 1, "state": "busy"})
        store.heartbeat(wid)
    return store


def make_pass(store: Store, idle: list[str] = ()) -> Pass:
    lease = store.acquire_lease("test", 30.0)
    pool = FreePool(lambda: [FreeWorker(w, w, "127.0.0.1") for w in idle])
    return Pass(store, SchedulerConfig(), "test", lease, store.now(), pool)


def job(jid: str, klass: str, dp: int, seq: int, phase: str = "Running", **fields) -> Job:
    spec = parse_spec(
        tiny_spec(jid, parallel={"dp": dp}, priority={"class": klass}, train={"global_batch": 60})
    )
    j = Job(id=jid, name=jid, spec=spec, seq=seq, generation=1, **fields)
    if phase == "Running":
        j.set("Running", True, "Started", "running", 1.0)
    elif phase == "Preempted":
        j.set("Preempted", True, "Preempted", "stopped", 1.0)
    return j


def on(store: Store, j: Job, workers: list[str]) -> Job:
    """`j`'s generation-1 assignment: one rank on each of `workers`."""
    entries = [RankEntry(n, w, 0, Coord(n, 0, 0)) for n, w in enumerate(workers)]
    asg = Assignment(j.id, 1, MeshShape(len(workers), 1, 1), "127.0.0.1", 20001, entries)
    store.r.hset(store.keys.job_assignment(j.id), mapping=flat(asg.to_fields()))
    return j


@pytest.fixture
def running(store) -> list[Job]:
    """One default-class job on w0, three low ones (1, 1 and 2 ranks) on the rest."""
    return [
        on(store, job("old-default", "default", 1, seq=1), ["w0"]),
        on(store, job("old-low", "low", 1, seq=2), ["w1"]),
        on(store, job("new-low", "low", 1, seq=3), ["w2"]),
        on(store, job("pair-low", "low", 2, seq=4), ["w3", "w4"]),
        on(store, job("peer", "high", 1, seq=5), ["w5"]),
    ]


@pytest.mark.parametrize(
    "dp,victims",
    [
        (1, {"new-low"}),  # one rank: the newest of the lowest single-rank jobs
        (2, {"new-low", "old-low"}),  # then the older of equal value
        (3, {"new-low", "old-low", "old-default"}),  # then a higher value, still single-rank
        (5, {"new-low", "old-low", "old-default", "pair-low"}),  # the larger job last
    ],
)
def test_victims_fewest_ranks_then_lowest_value_then_newest(store, running, dp, victims):
    urgent = job("urgent", "high", dp, seq=9, phase="Pending")
    assert try_preempt(make_pass(store), urgent, [*running, urgent], SchedulerConfig().priorities)
    assert {j.id for j in running if j.preempted_by == "urgent"} == victims
    assert "peer" not in victims  # equal value: never


def test_nothing_is_touched_when_even_every_candidate_would_not_make_it_fit(store, running):
    """Six workers, one held by an equal-valued job: a six-rank job cannot run by stopping the
    other five, so none of them is stopped."""
    urgent = job("urgent", "high", 6, seq=9, phase="Pending")
    assert not try_preempt(
        make_pass(store), urgent, [*running, urgent], SchedulerConfig().priorities
    )
    assert not any(j.preempted_by for j in running)


def test_a_class_that_does_not_preempt_stops_nobody(store, running):
    waiting = job("waiting", "default", 1, seq=9, phase="Pending")
    assert not try_preempt(
        make_pass(store), waiting, [*running, waiting], SchedulerConfig().priorities
    )
    assert not any(j.preempted_by for j in running)


def test_while_victims_stop_it_waits_and_chooses_nobody_else(store, running):
    urgent = job("urgent", "high", 1, seq=9, phase="Pending")
    classes = SchedulerConfig().priorities
    assert try_preempt(make_pass(store), urgent, [*running, urgent], classes)
    assert try_preempt(make_pass(store), urgent, [*running, urgent], classes)  # still stopping
    assert [j.id for j in running if j.preempted_by] == ["new-low"]


def test_yielded_victims_whose_workers_are_still_free_are_waited_for(store, running):
    """The victim stopped and released w2, whose agent has not reported idle yet: the job
    starts on it in a later pass, and stops nobody else meanwhile."""
    yielded = on(store, job("new-low", "low", 1, seq=3, phase="Preempted"), ["w2"])
    yielded.preempted_by = "urgent"
    jobs = [j for j in running if j.id != "new-low"] + [yielded]
    urgent = job("urgent", "high", 1, seq=9, phase="Pending")
    assert not try_preempt(make_pass(store), urgent, [*jobs, urgent], SchedulerConfig().priorities)
    assert [j.id for j in jobs if j.preempted_by] == ["new-low"]


def test_yielded_victims_whose_workers_another_job_took_make_it_choose_again(store, running):
    """The victim stopped, but a job of equal value took w2 before the preemptor's pass: the
    preemptor stops the next candidate instead of waiting behind a victim that will never
    be placed before it, while lower-valued jobs keep the pool."""
    yielded = on(store, job("new-low", "low", 1, seq=3, phase="Preempted"), ["w2"])
    yielded.preempted_by = "urgent"
    taker = on(store, job("taker", "high", 1, seq=8), ["w2"])
    jobs = [j for j in running if j.id != "new-low"] + [yielded, taker]
    urgent = job("urgent", "high", 1, seq=9, phase="Pending")
    assert try_preempt(make_pass(store), urgent, [*jobs, urgent], SchedulerConfig().priorities)
    assert {j.id for j in jobs if j.preempted_by == "urgent"} == {"new-low", "old-low"}
