"""The ETA in a job's status (controller/status.py), read through a real Redis: the step time
is the median over the newest history points, so one slow step cannot swing it while a
slowdown that lasts moves it."""

from __future__ import annotations

import pytest

from controller import history
from controller.jobs import Job
from controller.status import ETA_WINDOW, job_status
from services.records import HistoryPoint
from services.spec import parse_spec
from services.store import Store, flat

SPEC = parse_spec(
    {"name": "e", "model": {"preset": "tiny"}, "train": {"steps": 300, "global_batch": 4}}
)


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="eta:")
    yield s
    s.close()


def trained(store: Store, job: Job, step_times: list[float]) -> None:
    """One history point per step, as the pass writes them; the job at the newest."""
    for n, step_s in enumerate(step_times, start=job.step + 1):
        point = HistoryPoint(step=n, time=float(n), loss=3.0, step_s=step_s, generation=1)
        store.r.xadd(history.key(store.keys, job.id), flat(point.model_dump()))
        job.step, job.step_s = n, step_s


def eta(store: Store, job: Job) -> float:
    return job_status(store, job, alive_within_s=30).eta_s


def test_one_slow_step_does_not_swing_the_eta_but_a_slowdown_moves_it(store):
    job = Job(id="e", name="e", spec=SPEC, started_at=1.0)
    job.set("Running", True, "Training", "", 1.0)
    trained(store, job, [1.0] * 40)
    steady = eta(store, job)
    assert steady == pytest.approx(260 * 1.0)
    trained(store, job, [2.5])  # a checkpoint save in the step: the latest step took 2.5 s
    assert eta(store, job) == pytest.approx(steady - 1.0, rel=0.01)  # one step fewer to go
    trained(store, job, [1.0])
    assert eta(store, job) == pytest.approx(steady - 2.0, rel=0.01)
    # the mesh shrank: every step now takes 2 s; past half the window the ETA follows
    trained(store, job, [2.0] * (ETA_WINDOW // 2 + 1))
    remaining = SPEC.train.steps - job.step
    assert eta(store, job) == pytest.approx(remaining * 2.0)
