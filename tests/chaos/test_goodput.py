"""The goodput ledger (docs/architecture.md, "The goodput ledger") of a job that waited for
capacity, lost a trainer to SIGKILL and was preempted, on real processes and a real Redis:
three agents, frozen while the job is submitted (it waits for workers); rank 1's trainer
killed in generation 1 (its spare takes the rank); a high-priority job preempting it in
generation 2 (it commits, yields and queues again); generation 3 training it to the end. The
ledger adds up to the job's wall time, and each part is what its record or its events say."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from services.api import JobStatus
from tests.chaos.chaos import PHASES, Watch, at_step, kill, paced_spec, rank, succeeded, wait_record
from tests.security.smallpool import SmallPool
from tests.stack import tiny_spec, wait_phase, wait_until

pytestmark = pytest.mark.slow

PASS_S = 0.25  # the reconcile pass's interval: how far a charge may lag what it charges
WAIT_S = 3.0  # how long the job waits for workers (their zygotes import torch meanwhile)


@pytest.fixture
def pool(tmp_path):
    # the job is paced (chaos); every trainer forked from its agent's warm zygote, so that a
    # world's start costs no torch import
    p = SmallPool(tmp_path, 3, controller_flags=["--allow-chaos"], agent_flags=["--warm", "1"])
    yield p
    p.close()


def first_step(j: JobStatus) -> float:
    """When the world of `j`'s rank view trained its first step: its slowest rank's."""
    return max(r.first_step_at for r in j.mesh.ranks)


def trains(generation: int) -> Callable[[JobStatus], bool]:
    """Every rank of the job's world `generation` trained its first step."""
    return lambda j: (
        j.mesh.generation == generation
        and bool(j.mesh.ranks)
        and all(r.first_step_at for r in j.mesh.ranks)
    )


def waiting_for_workers(pool: SmallPool, spec: dict) -> Watch:
    """`spec` submitted while every agent is frozen (no live worker: admission has nothing to
    judge it by), waiting for capacity until they are thawed."""
    for agent in pool.agents:
        agent.kill(signal.SIGSTOP)
    try:
        wait_until(
            lambda: not any(w.alive for w in pool.client.workers()), 20, "the pool to go silent"
        )
        w = Watch(pool, pool.client.submit(spec).id)
        w.until(lambda j: j.condition("Running").reason == "WaitingForCapacity", 20, "a wait")
        time.sleep(WAIT_S)
    finally:
        for agent in pool.agents:
            agent.kill(signal.SIGCONT)
    return w


def test_the_ledger_of_a_wait_a_kill_and_a_preemption_adds_up_to_the_wall_time(pool):
    w = waiting_for_workers(pool, {**paced_spec("low"), "priority": {"class": "low"}})
    j1 = w.until(trains(1), 120, "generation 1 to train")
    victim = rank(j1, 1)
    path = pool.work / "workers" / victim.worker / "jobs" / j1.id / "g1" / "metrics-1.jsonl"
    wait_record(path, at_step(4), 60, "rank 1 at step 4")
    kill(victim.pid)
    w.until(lambda j: trains(2)(j) and j.step >= 8, 120, "generation 2 to train")

    high = pool.client.submit(
        tiny_spec(
            "high", priority={"class": "high"}, parallel={"dp": 1}, fault_tolerance={"spares": 0}
        )
    ).id
    w.until(lambda j: j.phase == "Pending", 90, "the job to yield")
    succeeded(pool, wait_phase(pool.client, high, ("Succeeded",), 120))
    j = w.finish()
    succeeded(pool, j)
    assert j.generation == 3 and j.restarts == 1
    wait_until(
        lambda: all(x.state == "idle" for x in pool.client.workers()), 30, "every worker idle"
    )

    g, events = j.goodput, pool.client.events(j.id, limit=1000)
    parts = g.parts.model_dump()
    wall = j.finished_at - j.submitted_at
    assert g.wall_s == pytest.approx(wall, abs=1e-6)
    assert sum(parts.values()) == pytest.approx(wall, rel=0.01), parts
    # recovery: the kill's record, fault to its new world's first step, phase by phase
    [rec] = j.recoveries
    assert rec.cause == "TrainerKilled" and rec.steps_lost <= 1, rec
    assert g.parts.recovery_s == pytest.approx(rec.durations["total_s"], abs=0.01), rec
    assert g.recovery_phases.model_dump() == pytest.approx(
        {p: rec.durations[p] for p in PHASES}, abs=0.01
    )
    # waiting: from the submission, through the wait for workers, to generation 1's first step
    [placed] = [e.time for e in events if e.reason == "Placed" and e.generation == 1]
    assert placed - j.submitted_at >= WAIT_S
    assert g.parts.waiting_s == pytest.approx(first_step(j1) - j.submitted_at, abs=PASS_S)
    # suspended: from the preemption's stop (its event) to generation 3's first step
    [stopped] = [e.time for e in events if e.reason == "Preempted"]
    assert g.parts.suspended_s == pytest.approx(first_step(j) - stopped, abs=PASS_S)
    # rank 0's saves and snapshots held training; no eval ran; at most a step redone after
    # the kill (restored from host memory), which the recovery's first step redid
    assert g.parts.checkpoint_s > 0 and g.parts.snapshot_s > 0 and g.parts.eval_s == 0, parts
    assert g.parts.redone_s <= 1.0, parts
    assert g.ettr == pytest.approx(g.parts.productive_s / (wall - g.parts.suspended_s))
    assert 0.2 < g.ettr < 1, parts

    other = pool.client.job(high).goodput  # the preemptor waited for the workers it freed
    assert sum(other.parts.model_dump().values()) == pytest.approx(other.wall_s, rel=0.01)
    assert other.parts.waiting_s > 0 and other.parts.recovery_s == 0
