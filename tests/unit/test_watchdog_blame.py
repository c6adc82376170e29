"""Ranks aborted by the NCCL watchdog (SIGABRT) are collateral, and the rank they waited on is
blamed by its collective progress or its process state (controller/aborts.py,
controller/health.py), from rank views as controller/ranks.py builds them."""

from __future__ import annotations

import signal

from controller import health
from controller.aborts import ABORT_SETTLE_S, blame_after_aborts, settling
from services.api import RankStatus

NOW = 1000.0
ABRT, KILL = -signal.SIGABRT, -signal.SIGKILL


def rank(n: int, entered: int | None, left: int | None, **report) -> RankStatus:
    return RankStatus.model_validate(
        {
            "rank": n,
            "worker": f"w{n}",
            "coord": {"dp": n, "pp": 0, "tp": 0},
            "local_rank": 0,
            "state": "running",
            "first_step_at": NOW - 100,
            "progress_at": NOW - 40,
            "step": 8,
            "coll_entered": entered,
            "coll_left": left,
            "proc_state": "S",
            **report,
        }
    )


def aborted(n: int, entered: int, left: int) -> RankStatus:
    return rank(n, entered, left, state="failed", exit_code=ABRT, exited_at=NOW - 1)


def blamed(ranks: list[RankStatus]) -> list[tuple[str, int]]:
    return [(f.cause, f.rank) for f in blame_after_aborts(ranks, NOW)]


def test_a_sigabrt_is_not_a_trainer_killed():
    ranks = [aborted(0, 25, 24), rank(1, 24, 24)]
    assert health.dead_or_killed(ranks, {"w0": NOW, "w1": NOW}, 2.0, NOW) == []


def test_a_sigkill_is_still_a_trainer_killed():
    ranks = [rank(0, 25, 24, state="failed", exit_code=KILL, exited_at=NOW - 1)]
    got = health.dead_or_killed(ranks, {"w0": NOW}, 2.0, NOW)
    assert [(f.cause, f.rank) for f in got] == [("TrainerKilled", 0)]


def test_the_stopped_rank_behind_the_aborted_ones_is_blamed_and_they_are_not():
    ranks = [aborted(0, 25, 24), aborted(1, 25, 24), rank(2, 24, 24, proc_state="T")]
    faults = blame_after_aborts(ranks, NOW)
    assert [(f.cause, f.rank, f.worker) for f in faults] == [("RankHung", 2, "w2")]
    assert faults[0].detail == (
        "it stopped entering collectives: entered 24 collective phases and left 24; its "
        "process is stopped; the NCCL watchdog aborted rank(s) [0, 1] (SIGABRT) waiting in "
        "collective phase 25"
    )
    assert faults[0].fault_at == NOW - 40  # its last progress


def test_a_runnable_rank_behind_is_blamed_by_its_counts_alone():
    # rank 3 spins outside any collective (state R); ranks 0-2 waited inside phase 25
    spinning = rank(3, 24, 24, proc_state="R", cpu_busy=True)
    ranks = [aborted(0, 25, 24), aborted(1, 25, 24), aborted(2, 25, 24), spinning]
    assert blamed(ranks) == [("RankHung", 3)]


def test_the_furthest_behind_is_blamed_not_a_rank_waiting_on_it_in_a_subgroup():
    ranks = [aborted(0, 26, 25), rank(1, 25, 24), rank(2, 24, 24)]
    assert blamed(ranks) == [("RankHung", 2)]


def test_a_live_rank_waiting_at_the_same_count_is_not_blamed():
    # its own watchdog has not fired yet: nothing says who stopped, so nobody is blamed
    assert blamed([aborted(0, 25, 24), rank(1, 25, 24)]) == []


def test_a_frozen_rank_at_the_same_count_is_blamed():
    # stopped inside the phase (between two of its collectives): same count, state T
    assert blamed([aborted(0, 25, 24), rank(1, 25, 24, proc_state="T")]) == [("RankHung", 1)]


def test_every_rank_aborted_blames_nobody_and_restarts_in_place():
    ranks = [aborted(0, 25, 24), aborted(1, 25, 24)]
    assert blamed(ranks) == []
    assert [f.cause for f in health.collateral_only(ranks, NOW)] == ["TrainerFailed"] * 2


def test_nothing_aborted_blames_nobody():
    assert blamed([rank(0, 25, 24), rank(1, 24, 24, proc_state="T")]) == []


# -- a failure with no root cause waits for a silent peer's death to be named first ----------
def failed_and_silent_peer() -> list[RankStatus]:
    return [
        rank(0, 25, 24, state="failed", exit_code=1, exited_at=NOW - 0.3),
        rank(1, 25, 24),
    ]


def test_collateral_waits_while_a_peer_has_not_beaten_since_the_failure():
    # w1 last beat before w0's trainer failed: it may be the dead host that took w0 down
    seen = {"w0": NOW - 0.1, "w1": NOW - 0.6}
    assert health.collateral_only(failed_and_silent_peer(), NOW, seen) == []


def test_collateral_restarts_once_every_worker_beat_after_the_failure():
    seen = {"w0": NOW - 0.1, "w1": NOW - 0.2}
    faults = health.collateral_only(failed_and_silent_peer(), NOW, seen)
    assert [(f.cause, f.rank) for f in faults] == [("TrainerFailed", 0)]


# -- every rank aborted: the flight recorder's dumps (worker/flight_record.py) -----------------
def dumped(n: int, completed: int, pending: int | None, state: str | None) -> RankStatus:
    entry = {"desc": "mesh_dp", "completed": completed, "pending": pending, "state": state}
    return rank(
        n,
        25,
        24,
        state="failed",
        exit_code=ABRT,
        exited_at=NOW - 1,
        flight={"4": {**entry, "op": "nccl:all_reduce"}},
    )


def test_a_rank_whose_next_collective_never_started_on_its_device_is_blamed():
    # a GPU stuck in a kernel: its host queued collective 41 as its peers' hosts did (same
    # counts), but only the peers' kernels started, waiting for it
    ranks = [
        dumped(0, 40, 41, "started"),
        dumped(1, 40, 41, "scheduled"),
        dumped(2, 40, 41, "started"),
    ]
    faults = blame_after_aborts(ranks, NOW)
    assert [(f.cause, f.rank) for f in faults] == [("RankHung", 1)]
    assert faults[0].detail.startswith(
        "flight recorder, process group 4 (mesh_dp): it completed collective #40, #41 "
        "(nccl:all_reduce) scheduled; rank 0 completed collective #40, #41 (nccl:all_reduce) "
        "started; the NCCL watchdog aborted rank(s) [0, 1, 2]"
    ), faults[0].detail


def test_the_rank_with_the_lowest_completed_sequence_is_blamed():
    ranks = [
        dumped(0, 41, 42, "started"),
        dumped(1, 40, 41, "started"),
        dumped(2, 41, 42, "started"),
    ]
    assert blamed(ranks) == [("RankHung", 1)]


def test_dumps_that_agree_blame_nobody():
    ranks = [dumped(0, 40, 41, "started"), dumped(1, 40, 41, "started")]
    assert blamed(ranks) == []


def test_a_group_with_one_dump_tells_nothing():
    ranks = [dumped(0, 40, 41, "started"), aborted(1, 25, 24)]
    assert blamed(ranks) == []


def test_the_controller_waits_a_bounded_time_for_the_rest_of_the_aborts():
    live = rank(1, 25, 24)
    assert settling([aborted(0, 25, 24), live], NOW)  # aborted 1 s ago
    late = rank(0, 25, 24, state="failed", exit_code=ABRT, exited_at=NOW - ABORT_SETTLE_S - 0.1)
    assert not settling([late, live], NOW)
    assert not settling([aborted(0, 25, 24), aborted(1, 25, 24)], NOW)  # nobody left to abort
