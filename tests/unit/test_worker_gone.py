"""A worker whose agent deregistered (a clean stop removes its beat) has no beat at all: it is
dead as of when its ranks last reported, never "silent for 1795770517.5s" since the epoch
(controller/health.py, the recovery's detect duration in controller/faults.py)."""

from __future__ import annotations

from controller import health
from services.api import RankStatus

NOW = 1_795_770_551.0


def rank(n: int, **report) -> RankStatus:
    return RankStatus.model_validate(
        {
            "rank": n,
            "worker": f"w{n}",
            "coord": {"dp": n, "pp": 0, "tp": 0},
            "local_rank": 0,
            "state": "running",
            "progress_at": NOW - 0.4,
            **report,
        }
    )


def test_a_deregistered_worker_is_dead_since_its_last_report_not_since_the_epoch():
    [f] = health.dead_or_killed([rank(0), rank(1)], {"w0": NOW - 0.1}, 2.0, NOW)
    assert (f.cause, f.rank, f.fault_at) == ("WorkerDead", 1, NOW - 0.4)
    assert f.detail == "worker w1 stopped (deregistered)"


def test_a_silent_worker_is_still_timed_from_its_last_beat():
    [f] = health.dead_or_killed([rank(0)], {"w0": NOW - 3.0}, 2.0, NOW)
    assert (f.cause, f.fault_at) == ("WorkerDead", NOW - 3.0)
    assert f.detail == "worker w0 silent for 3.0s (dead_after_s 2.0)"
