"""`meshkeeper_goodput_ratio` (controller/metrics_jobs.py) as a scrape of a real Redis reads
it: the wall time since the start less each recovery's time and its redone steps' time."""

from __future__ import annotations

import pytest

from controller.jobs import Job
from controller.metrics_jobs import JobFamilies
from services.records import RecoveryRecord
from services.spec import parse_spec
from services.store import Store

SPEC = parse_spec(
    {"name": "g", "model": {"preset": "tiny"}, "train": {"steps": 200, "global_batch": 4}}
)


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="goodput:")
    yield s
    s.close()


def recovery(n: int, fault_at: float, **done) -> RecoveryRecord:
    return RecoveryRecord(
        n=n, cause="TrainerKilled", from_generation=n, fault_at=fault_at, detected_at=fault_at + 1,
        **done,
    )  # fmt: skip


def scraped_goodput(store: Store, job: Job, now: float) -> float:
    families = JobFamilies()
    families.add(store, job, now, set())
    [sample] = [s for s in families.goodput.samples if s.labels["job_id"] == job.id]
    return sample.value


def test_two_kills_and_25_redone_steps_are_lost_time(store):
    now = store.now()
    two_kills = [
        recovery(1, now - 70, completed_at=now - 61, steps_lost=20, durations={"total_s": 8.0}),
        recovery(2, now - 30, completed_at=now - 22, steps_lost=5, durations={"total_s": 7.0}),
    ]
    # 100 s of wall time, 100 steps kept at 1 s each (the latest step's time): the old
    # reading, kept steps x step time over the wall time, was 1.0
    job = Job(id="g", name="g", spec=SPEC, step=100, step_s=1.0, started_at=now - 100)
    job.recoveries = two_kills
    assert scraped_goodput(store, job, now) == pytest.approx(1 - (8 + 7 + 25 * 1.0) / 100)


def test_an_open_recovery_counts_until_now(store):
    now = store.now()
    job = Job(id="g", name="g", spec=SPEC, step=50, step_s=1.0, started_at=now - 100)
    job.recoveries = [recovery(1, now - 10)]
    assert scraped_goodput(store, job, now) == pytest.approx(0.9)
