"""Priorities and preemption (docs/control-plane.md, "Priorities and preemption") on pools of
real agents. One low-priority dp2 job (and its spare) fills three workers: a high-priority job
arrives, the low one commits a step and yields, the high one runs to its end, and the low one
is placed again and continues from its commit. Both succeed; the low one with the loss curve
of its uninterrupted run, bit for bit, and no step redone. And a storm: two high jobs at once
on a pool two low jobs fill, each taking one victim, never the other's, no worker in two
jobs at any moment."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import Watch, paced_spec, resumed_once, start, succeeded
from tests.security.smallpool import SmallPool
from tests.stack import TERMINAL, tiny_spec, wait_phase, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def pool(request, tmp_path):
    agents = getattr(request, "param", 3)
    p = SmallPool(tmp_path, agents, controller_flags=["--allow-chaos"])  # the low jobs are paced
    yield p
    p.close()


def test_a_high_priority_job_preempts_a_low_one_that_resumes_to_the_exact_loss(pool, uninterrupted):
    spec = {**paced_spec("low"), "priority": {"class": "low"}}
    want = uninterrupted(spec)
    w, _ = start(pool, spec)  # two ranks and a spare: the whole pool
    w.until(lambda j: j.step >= 4, 90, "the low job to train")

    high = pool.client.submit(
        tiny_spec("high", priority={"class": "high"}, fault_tolerance={"spares": 0})
    ).id
    yielded = w.until(lambda j: j.phase == "Pending", 90, "the low job to yield")
    why = yielded.condition("Preempted")
    assert why.status == "True" and f"preempted by {high}" in why.message, yielded.conditions
    assert (yielded.generation, yielded.restarts) == (1, 0)
    wait_phase(pool.client, high, ("Running",), 60)
    assert pool.client.job(w.jid).phase == "Pending"  # the workers it freed went to `high`
    done = wait_phase(pool.client, high, ("Succeeded",), 180)
    succeeded(pool, done)
    j = w.finish()
    assert j.condition("Preempted").status == "False"  # placed again: history, not state
    stop = resumed_once(pool, j, want)
    assert stop > 4
    told = [e.message for e in pool.client.events(w.jid, limit=500) if e.reason == "Preempting"]
    assert told == [f"stopping to free its workers for {high} (priority class high)"]


def low(name: str) -> dict:
    """A paced dp2 job of the lowest class, without a spare: two of them fill four workers.
    60 steps of 0.25 s: both still far from their end when the high jobs come (a stop asked
    too close to the end is not issued: the job finishes)."""
    spec = {**paced_spec(name), "priority": {"class": "low"}}
    spec["train"] = {**spec["train"], "steps": 60}
    return {**spec, "fault_tolerance": {**spec["fault_tolerance"], "spares": 0}}


def preempted_for(pool: SmallPool, jid: str) -> list[str]:
    """The jobs `jid` was told to stop for (its Preempting events)."""
    prefix = "stopping to free its workers for "
    return [
        e.message.removeprefix(prefix).split(" ")[0]
        for e in pool.client.events(jid, limit=500)
        if e.reason == "Preempting" and e.message.startswith(prefix)
    ]


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_two_preempting_jobs_take_one_victim_each_and_no_worker_twice(pool, uninterrupted):
    want = uninterrupted(low("low-a"))
    older = Watch(pool, pool.client.submit(low("low-a")).id)
    newer = Watch(pool, pool.client.submit(low("low-b")).id)
    for w in (older, newer):
        w.until(lambda j: j.phase == "Running" and j.step >= 4, 120, "both low jobs to train")
    high = [
        pool.client.submit(
            tiny_spec(f"high-{x}", priority={"class": "high"}, fault_tolerance={"spares": 0})
        ).id
        for x in "ab"
    ]
    jobs = [older.jid, newer.jid, *high]

    def disjoint() -> bool:
        """No worker in the world of two running jobs at once (a job that yielded keeps only
        its final view); True once every job has ended."""
        seen: dict[str, str] = {}
        states = [pool.client.job(jid) for jid in jobs]
        for j in states:
            if j.phase == "Running":
                for wid in {r.worker for r in j.mesh.ranks} | set(j.mesh.spares):
                    assert seen.setdefault(wid, j.id) == j.id, f"{wid} in {seen[wid]} and {j.id}"
        return all(j.phase in TERMINAL for j in states)

    wait_until(disjoint, 400, "every job to end, no worker in two", every=0.1)
    # the first high job stops the newest low one; the second, never a job already stopping,
    # the other: one victim each
    assert preempted_for(pool, newer.jid) == [high[0]]
    assert preempted_for(pool, older.jid) == [high[1]]
    for jid in high:
        succeeded(pool, pool.client.job(jid))
    for w in (older, newer):
        assert resumed_once(pool, w.finish(), want) > 4
    assert sum(w.alive and not w.job for w in pool.client.workers()) == 4  # all back
