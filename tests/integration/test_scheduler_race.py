"""One reconcile pass never gives a worker to two jobs (real redis-server, real `Scheduler`;
the agents' side is written into Redis the way worker/agent.py writes it).

The pass visits open jobs in submission order. A job waiting for capacity after a failed
recovery counts as pending, so a pending job can come before a running one: pending job A,
running job R whose trainer was just killed, pending job P. With two idle workers, A takes
one, R's recovery the other, and P must wait, not get the worker R just took."""

from __future__ import annotations

import threading

import pytest

from controller.availability import RedisAvailability
from controller.jobs import Job, submit
from controller.scheduler import Scheduler, SchedulerConfig
from services.assignment import Assignment
from services.spec import parse_spec
from services.store import Store
from services.tokens import new_token
from tests.stack import wait_until

DEAD_AFTER_S = 1.5  # the spec's floor: the test waits this long for Redis to be steady


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="race:")
    yield s
    s.close()


def agent_up(store: Store, wid: str, state: str = "idle") -> None:
    """What the controller writes when an agent joins, plus a fresh heartbeat."""
    store.join_worker(
        wid,
        {
            "host": "h1",
            "address": "127.0.0.1",
            "labels": {"host": "h1"},
            "devices": 1,
            "state": state,
        },
        new_token(),
    )
    store.heartbeat(wid)


def trainer_killed(store: Store, wid: str, job: str, generation: int) -> None:
    """The agent's progress report after its rank-0 trainer died of SIGKILL."""
    store.write_progress(
        wid,
        {
            "job": job,
            "generation": generation,
            "state": "failed",
            "ranks": {"0": {"state": "failed", "exit_code": -9, "exited_at": store.now()}},
        },
    )


def tiny_job(store: Store, name: str, dp: int = 1, **fault_tolerance) -> str:
    """A tiny-model job of `dp` one-rank replicas, submitted as the API does."""
    spec = {
        "name": name,
        "model": {"preset": "tiny"},
        "parallel": {"dp": dp},
        "train": {"steps": 100, "global_batch": 2 * dp},
        "fault_tolerance": {
            "spares": 0,
            "min_dp": 1,
            "dead_after_s": DEAD_AFTER_S,
            **fault_tolerance,
        },
    }
    return submit(store, parse_spec(spec), owner="tester")[0]


def job(store: Store, jid: str) -> Job:
    return Job.from_hash(jid, store.job(jid))


def owners(store: Store, jids: list[str]) -> dict[str, list[str]]:
    """worker -> the open jobs whose current assignment holds it."""
    out: dict[str, list[str]] = {}
    for jid in jids:
        asg = Assignment.from_fields(store.job_assignment(jid))
        if asg is not None and asg.generation == int(store.job(jid)["generation"]):
            for wid in asg.workers:
                out.setdefault(wid, []).append(jid)
    return out


@pytest.fixture
def availability(store):
    """Redis as the controller's watcher thread sees it (controller/availability.py): silence
    is judged only once Redis has been steadily available for a job's dead_after_s."""
    seen, stop = RedisAvailability(), threading.Event()
    watcher = threading.Thread(target=seen.watch, args=(store, stop), daemon=True)
    watcher.start()
    yield seen
    stop.set()
    watcher.join(5)


def test_pending_jobs_and_a_recovery_in_one_pass_never_share_a_worker(store, availability):
    sched = Scheduler(store, SchedulerConfig(worker_alive_s=30), "ctl", availability=availability)
    lease = store.acquire_lease("ctl", ttl_s=60)
    for wid in ("w1", "w2"):
        agent_up(store, wid)
    a, r = tiny_job(store, "a"), tiny_job(store, "r")
    sched.run_once(lease)  # a on w1, r on w2
    assert owners(store, [a, r]) == {"w1": [a], "w2": [r]}

    # a's worker goes silent (its host died) while no other worker is idle: no spare, dp
    # already 1, so a waits for capacity and releases w1. (A killed trainer whose agent lives
    # would restart in place instead.)
    for wid in ("w1", "w2"):
        agent_up(store, wid, state="busy")
    store.r.zadd(store.keys.workers_seen(), {"w1": store.now() - 60})
    wait_until(lambda: availability.steady(DEAD_AFTER_S), 10, "Redis to be judged steady")
    sched.run_once(lease)
    assert job(store, a).awaiting_capacity
    assert not store.worker_assignment("w1")

    # The pass under test: a (pending again), r (its trainer killed now: its one-rank
    # worker moves to an idle one), p (new), and two idle workers: w1 (back) and w3.
    trainer_killed(store, "w2", r, 1)
    agent_up(store, "w1")
    agent_up(store, "w2", state="busy")
    agent_up(store, "w3")
    p = tiny_job(store, "p")
    sched.run_once(lease)

    held = owners(store, [a, r, p])
    shared = {wid: jobs for wid, jobs in held.items() if len(jobs) > 1}
    assert not shared, f"workers given to more than one job in one pass: {shared}"
    for wid, (jid,) in held.items():  # each pointer names the job that holds the worker
        assert store.worker_assignment(wid).get("job") == jid, (wid, jid)
    assert held["w1"] == [a] and held["w3"] == [r]  # a restarted, r's rank moved w2 -> w3
    waiting = job(store, p)  # nothing left for p: it waits for capacity
    assert (
        waiting.phase == "Pending"
        and waiting.condition("Running")["reason"] == "WaitingForCapacity"
    )
