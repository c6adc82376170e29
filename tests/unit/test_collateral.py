"""A rank that failed with no root cause is restarted in place, but not while a worker of the
job has been silent since the failure: that worker's death may be the cause, and
`dead_after_s` names it first (controller/health.py `collateral_only`)."""

from __future__ import annotations

from controller import health
from services.api import RankStatus

NOW = 1000.0


def rank(n: int, **report) -> RankStatus:
    return RankStatus.model_validate(
        {
            "rank": n,
            "worker": f"w{n}",
            "coord": {"dp": n, "pp": 0, "tp": 0},
            "local_rank": 0,
            "state": "running",
            **report,
        }
    )


RANKS = [rank(0, state="failed", exit_code=1, exited_at=NOW - 0.3), rank(1)]


def test_waits_while_a_peer_has_not_beaten_since_the_failure():
    # w1 last beat before w0's trainer failed: it may be the dead host that took w0 down
    assert health.collateral_only(RANKS, NOW, {"w0": NOW - 0.1, "w1": NOW - 0.6}) == []


def test_restarts_once_every_worker_beat_after_the_failure():
    faults = health.collateral_only(RANKS, NOW, {"w0": NOW - 0.1, "w1": NOW - 0.2})
    assert [(f.cause, f.rank) for f in faults] == [("TrainerFailed", 0)]


def test_without_heartbeats_to_judge_it_restarts_at_once():
    # Redis just restarted: silence proves nothing (controller/following.py)
    assert [f.rank for f in health.collateral_only(RANKS, NOW, None)] == [0]
