"""The goodput ledger's metrics (controller/metrics_jobs.py) as a scrape of a real Redis reads
them: `meshkeeper_job_seconds_total{cause}` is the ledger's parts as charged for good
(controller/goodput.py), so it never goes back, and `meshkeeper_goodput_ratio` its ETTR."""

from __future__ import annotations

import pytest

from controller.goodput import Ledger
from controller.jobs import Job
from controller.metrics_jobs import JobFamilies
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


def scrape(store: Store, job: Job, now: float) -> tuple[dict[str, float], float | None]:
    """(seconds by cause, the ratio) as one scrape exports them for `job`."""
    families = JobFamilies()
    families.add(store, job, now, set())
    seconds = {
        s.labels["cause"]: s.value
        for s in families.seconds.samples
        if s.labels["job_id"] == job.id and s.name.endswith("_total")
    }
    ratio = [s.value for s in families.goodput.samples if s.labels["job_id"] == job.id]
    return seconds, ratio[0] if ratio else None


def test_the_counters_are_the_ledgers_parts_and_the_ratio_its_ettr(store):
    now = store.now()
    parts = {
        "productive_s": 60.0,
        "redone_s": 4.0,
        "recovery_s": 8.0,
        "checkpoint_s": 3.0,
        "snapshot_s": 1.0,
        "eval_s": 2.0,
        "waiting_s": 2.0,
        "suspended_s": 20.0,
    }
    job = Job(id="g", name="g", spec=SPEC, generation=2, submitted_at=now - 100)
    job.set("Running", True, "Training", "training", now - 50)
    job.goodput = Ledger(at=now, parts=parts)  # charged up to now
    seconds, ratio = scrape(store, job, now)
    assert seconds == {k.removesuffix("_s"): v for k, v in parts.items()}
    assert ratio == pytest.approx(60.0 / (100.0 - 20.0))


def test_a_waiting_job_counts_its_wait_at_every_scrape(store):
    """Nothing but a placement ends a wait, and the wait is all waiting: the counter grows
    between the passes that write the ledger, and the ratio is 0 (nothing trained yet)."""
    now = store.now()
    job = Job(id="g", name="g", spec=SPEC, submitted_at=now - 30)
    job.set("Running", False, "WaitingForCapacity", "needs 2 workers", now - 30)
    first, ratio = scrape(store, job, now)
    later, _ = scrape(store, job, now + 5)
    assert (first["waiting"], later["waiting"], ratio) == (30.0, 35.0, 0.0)
    assert sum(first.values()) == 30.0
