"""The pass writes a running job's progress and its history together (real redis-server,
real `Scheduler`; the agent's report written as worker/agent writes it): a step that advanced
is one `HistoryPoint` in `job:{jid}:history`, in the transaction that stores the step, with
the loss of that very step; a pass that sees no new step adds none."""

from __future__ import annotations

import pytest

from controller.jobs import Job
from controller.scheduler import Scheduler, SchedulerConfig
from services.records import HistoryPoint
from services.store import Store
from tests.integration.test_scheduler_race import agent_up, tiny_job


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="hist:")
    yield s
    s.close()


def report(store: Store, jid: str, steps: dict[str, tuple[int, float]]) -> None:
    """Both ranks training in generation 1: rank -> (steps completed, that step's loss)."""
    now = store.now()
    for wid, rank in (("w1", "0"), ("w2", "1")):
        store.heartbeat(wid, jid, 1)
        step, loss = steps[rank]
        store.write_progress(
            wid,
            {
                "job": jid,
                "generation": 1,
                "state": "running",
                "ranks": {
                    rank: {
                        "state": "running",
                        "step": step,
                        "loss": loss,
                        "tokens_per_s": 100.0 + step,
                        "step_s": 0.5,
                        "first_step_at": now - 5,
                        "progress_at": now,
                    }
                },
            },
        )


def history(store: Store, jid: str) -> list[HistoryPoint]:
    return [
        HistoryPoint.model_validate(f) for _, f in store.r.xrange(store.keys.job(jid) + ":history")
    ]


def test_each_new_step_is_one_history_point_with_its_own_loss(store):
    sched = Scheduler(store, SchedulerConfig(worker_alive_s=30), "ctl")
    lease = store.acquire_lease("ctl", ttl_s=60)
    for wid in ("w1", "w2"):
        agent_up(store, wid)
    jid = tiny_job(store, "hist", dp=2)
    sched.run_once(lease)  # placed: generation 1
    assert history(store, jid) == []

    report(store, jid, {"0": (4, 3.5), "1": (3, 3.7)})  # rank 0 a step ahead
    sched.run_once(lease)
    job = Job.from_hash(jid, store.job(jid))
    assert (job.step, job.loss) == (3, 3.7)  # the slowest rank's step, with its loss
    [point] = history(store, jid)
    assert (point.step, point.loss, point.tokens_per_s, point.generation) == (3, 3.7, 103.0, 1)

    sched.run_once(lease)  # nothing new reported: no new point
    assert len(history(store, jid)) == 1

    report(store, jid, {"0": (5, 3.2), "1": (5, 3.2)})
    sched.run_once(lease)
    assert [(p.step, p.loss) for p in history(store, jid)] == [(3, 3.7), (5, 3.2)]


def test_a_step_no_rank_trained_yet_is_not_stored_beside_the_previous_steps_loss(store):
    sched = Scheduler(store, SchedulerConfig(worker_alive_s=30), "ctl")
    lease = store.acquire_lease("ctl", ttl_s=60)
    for wid in ("w1", "w2"):
        agent_up(store, wid)
    jid = tiny_job(store, "resumed", dp=2)
    sched.run_once(lease)
    report(store, jid, {"0": (12, 3.5), "1": (12, 3.5)})
    sched.run_once(lease)
    # every rank restored a snapshot of step 14 and has not trained yet: each reports the
    # step it resumes at, with no loss (worker/agent/rank_progress.py). The job's hash once
    # took step 14 and kept step 12's loss (a None is not written), and every screen then
    # showed step 14 with step 12's loss.
    report(store, jid, {"0": (14, None), "1": (14, None)})
    sched.run_once(lease)
    job = Job.from_hash(jid, store.job(jid))
    assert (job.step, job.loss) == (12, 3.5)
    report(store, jid, {"0": (15, 3.1), "1": (15, 3.1)})
    sched.run_once(lease)
    job = Job.from_hash(jid, store.job(jid))
    assert (job.step, job.loss) == (15, 3.1)
    assert [(p.step, p.loss) for p in history(store, jid)] == [(12, 3.5), (15, 3.1)]
