"""The goodput ledger through real passes (controller/scheduler.py) on a real redis-server, the
agents' reports written as agents write them: a job waits for a second worker, starts and
trains; Redis is killed and restarted, another controller takes the lease, and the ledger goes
on from what Redis kept. Its parts add up to the wall time, the wait ends at the world's first
step, rank 0's overheads are charged once, and a pass fenced out writes none of it."""

from __future__ import annotations

import time

import pytest

from controller.scheduler import Scheduler, SchedulerConfig
from controller.status import job_status
from services.store import Fenced, Store
from tests.integration.test_scheduler_race import agent_up, job, tiny_job


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="gp:")
    yield s
    s.close()


def report(store: Store, jid: str, step: int, first_at: float, overheads: dict) -> None:
    """Both ranks of generation 1 training at `step`; rank 0 with its overhead totals."""
    now = store.now()
    for wid, rank in (("w1", "0"), ("w2", "1")):
        store.heartbeat(wid, jid, 1)
        fields = {
            "state": "running",
            "step": step,
            "loss": 3.0,
            "tokens_per_s": 100.0,
            "step_s": 0.05,
            "first_step_at": first_at,
            "progress_at": now,
            "overheads": overheads if rank == "0" else {},
        }
        store.write_progress(
            wid, {"job": jid, "generation": 1, "state": "running", "ranks": {rank: fields}}
        )


def test_the_ledger_adds_up_across_a_redis_restart_and_a_new_leader(store, redis_server):
    first = Scheduler(store, SchedulerConfig(worker_alive_s=30), "first")
    lease = store.acquire_lease("first", ttl_s=60)
    agent_up(store, "w1")
    jid = tiny_job(store, "gp", dp=2)
    first.run_once(lease)
    assert job(store, jid).phase == "Pending"  # two ranks, one worker: it waits
    time.sleep(0.2)
    agent_up(store, "w2")
    first.run_once(lease)
    assert job(store, jid).generation == 1
    time.sleep(0.2)
    stepped = store.now()  # the world's first step
    report(store, jid, 1, stepped, {})
    first.run_once(lease)
    time.sleep(0.3)
    report(store, jid, 5, stepped, {"checkpoint_s": 0.05, "eval_s": 0.02})
    first.run_once(lease)
    kept = job(store, jid).goodput

    redis_server.kill()
    redis_server.start()  # the AOF kept the job, its ledger with it
    assert job(store, jid).goodput == kept
    store.release_lease(lease)
    second = Scheduler(store, SchedulerConfig(worker_alive_s=30), "second")
    taken = store.acquire_lease("second", ttl_s=60)
    time.sleep(0.3)
    report(store, jid, 9, stepped, {"checkpoint_s": 0.05, "eval_s": 0.04})
    with pytest.raises(Fenced):  # the old leader's pass: its write is refused whole
        first.run_once(lease)
    assert job(store, jid).goodput == kept
    second.run_once(taken)
    second.run_once(taken)  # nothing new: nothing charged twice

    j = job(store, jid)
    led = j.goodput
    assert led.parts["waiting_s"] == pytest.approx(stepped - j.submitted_at, abs=1e-6)
    assert (led.parts["checkpoint_s"], led.parts["eval_s"]) == pytest.approx((0.05, 0.04))
    assert sum(led.parts.values()) == pytest.approx(led.at - j.submitted_at, abs=1e-6)
    assert led.parts["productive_s"] > 0.5  # trained from the first step to the last report
    status = job_status(store, j, 30).goodput
    assert sum(status.parts.model_dump().values()) == pytest.approx(status.wall_s, abs=1e-6)
    assert status.wall_s >= led.at - j.submitted_at
    assert 0 < status.ettr < 1
