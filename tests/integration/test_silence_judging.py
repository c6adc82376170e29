"""Heartbeat silence is judged against Redis's availability as the controller saw it (a real
redis-server, a real `Scheduler`, one reconcile pass per 0.25 s as controller/service.py runs
them, and the controller's own watcher thread timing Redis, in real time).

On one host a SIGSTOPped redis-server still queues the beats sent during the stall and stamps
them when it resumes, so tests/chaos/test_redis_faults.py cannot tell a controller that
ignores the stall from one that does not. Here the beats really are lost (their scores are
made old after the stall), and what differs is only what the controller saw of Redis: right
after a stall nobody is declared dead; once Redis has been steady for `dead_after_s`, the
same silence is. And a pass that merely took long (Redis answering all along) holds nothing
back: its silence is judged at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from controller.availability import RedisAvailability
from controller.jobs import Job
from controller.scheduler import Scheduler, SchedulerConfig
from services.store import Store
from tests.integration.test_scheduler_race import agent_up, tiny_job

DEAD_AFTER_S = 2.0
PASS_S = 0.25


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="silence:")
    yield s
    s.close()


class Controller:
    """The reconcile loop of controller/service.py, one pass at a time, and its watcher."""

    def __init__(self, store: Store):
        self.store = store
        self.availability = RedisAvailability()
        self.sched = Scheduler(
            # workers silent for dead_after_s are not placed on either: once the job has
            # stopped for capacity it must not be re-placed on the silent workers (and judged
            # dead a second time) within the same few passes
            store,
            SchedulerConfig(worker_alive_s=DEAD_AFTER_S),
            "ctl",
            availability=self.availability,
        )
        self.lease = store.acquire_lease("ctl", ttl_s=600)
        self.stop = threading.Event()
        self.watcher = threading.Thread(
            target=self.availability.watch, args=(store, self.stop), daemon=True
        )
        self.watcher.start()

    def passes(self, seconds: float, before_each=lambda: None) -> None:
        for _ in range(round(seconds / PASS_S)):
            time.sleep(PASS_S)
            before_each()
            self.sched.run_once(self.lease)

    def close(self) -> None:
        self.stop.set()
        self.watcher.join(5)


@pytest.fixture
def ctl(store):
    c = Controller(store)
    yield c
    c.close()


def running_job(store: Store, ctl: Controller) -> str:
    """A dp2 job on w1 and w2, placed, its ranks training for 3 x dead_after_s."""
    for wid in ("w1", "w2"):
        agent_up(store, wid)
    jid = tiny_job(store, "silence", dp=2, dead_after_s=DEAD_AFTER_S, hang_after_s=600)
    ctl.passes(PASS_S)
    assert Job.from_hash(jid, store.job(jid)).generation == 1
    ctl.passes(3 * DEAD_AFTER_S, lambda: [training(store, w, jid) for w in ("w1", "w2")])
    return jid


def training(store: Store, wid: str, jid: str) -> None:
    """A fresh beat and the agent's report of its rank training in generation 1."""
    store.heartbeat(wid, jid, 1)
    now = store.now()
    store.write_progress(
        wid,
        {
            "job": jid,
            "generation": 1,
            "state": "running",
            "ranks": {
                str(int(wid[1:]) - 1): {
                    "state": "running",
                    "step": 3,
                    "first_step_at": now - 5,
                    "progress_at": now,
                }
            },
        },
    )


def test_silence_right_after_a_stall_is_not_death_but_steady_silence_is(store, ctl, redis_server):
    jid = running_job(store, ctl)

    # A stall: redis-server stopped for 1.5 x dead_after_s, and the agents' beats of that
    # time are gone (made as old as the stall).
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.5 * DEAD_AFTER_S)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    stale = store.now() - 1.5 * DEAD_AFTER_S
    store.r.zadd(store.keys.workers_seen(), {"w1": stale, "w2": stale})
    ctl.passes(DEAD_AFTER_S - 2 * PASS_S)  # Redis answers again, but not yet for dead_after_s
    job = Job.from_hash(jid, store.job(jid))
    assert (job.generation, job.restarts, job.recoveries) == (1, 0, []), job.recoveries
    assert ctl.availability.gaps >= 1

    ctl.passes(4 * PASS_S)  # now steady for dead_after_s, and the silence is real
    job = Job.from_hash(jid, store.job(jid))
    assert job.restarts == 1 and [r.cause for r in job.recoveries] == ["WorkerDead"], job.recoveries


def test_a_long_pass_with_redis_up_holds_no_judging(store, ctl):
    jid = running_job(store, ctl)

    # The agents fall silent, and the next pass comes only after dead_after_s + 0.5 s (the
    # pass before wrote a big recovery): Redis answered the watcher all along, so the
    # silence is judged in that very pass.
    time.sleep(DEAD_AFTER_S + 0.5)
    ctl.sched.run_once(ctl.lease)
    job = Job.from_hash(jid, store.job(jid))
    assert job.restarts == 1 and [r.cause for r in job.recoveries] == ["WorkerDead"], job.recoveries
    assert ctl.availability.gaps == 0
