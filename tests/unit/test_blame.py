"""Blame for hung ranks (controller/health.py), from rank views as controller/ranks.py builds
them; the counters' round trip through the trainer's shared file (worker/progress.py); the
spec's new fault_tolerance fields."""

from __future__ import annotations

import pytest

from controller import health
from services.api import RankStatus
from services.spec import SpecError, parse_spec
from worker.progress import Collectives, counters_path, read_counters

NOW, HANG, PARAMS = 1000.0, 10.0, 10**9


def rank(
    n: int, entered, left, *, state="running", proc_state="S", busy=False, progress_at=NOW - 60
):
    """A rank's report as a dict (tests edit it), made a `RankStatus` by `view`."""
    return {
        "rank": n,
        "worker": f"w{n}",
        "coord": {"dp": n, "pp": 0, "tp": 0},
        "local_rank": 0,
        "state": state,
        "first_step_at": NOW - 100,
        "progress_at": progress_at,
        "step": 8,
        "coll_entered": entered,
        "coll_left": left,
        "proc_state": proc_state,
        "cpu_busy": busy,
    }


def view(ranks: list[dict]) -> list[RankStatus]:
    """The rank view as controller/ranks.py builds it."""
    return [RankStatus.model_validate(r) for r in ranks]


def hangs(ranks: list[dict]):
    return health.hangs(view(ranks), HANG, NOW, PARAMS)


def blamed(ranks):
    return [(f.cause, f.rank, f.worker) for f in hangs(ranks)]


def test_busy_looping_rank_with_the_lowest_entered_count_is_blamed():
    # rank 2 spins (R) after leaving phase 24; ranks 0, 1, 3 sit inside phase 25, waiting for it
    ranks = [
        rank(0, 25, 24),
        rank(1, 25, 24),
        rank(2, 24, 24, proc_state="R", busy=True),
        rank(3, 25, 24),
    ]
    assert blamed(ranks) == [("RankHung", 2, "w2")]
    assert "wait inside collective phase 25" in hangs(ranks)[0].detail


def test_lowest_count_is_blamed_not_the_ranks_in_between():
    # rank 1 waits in an earlier subgroup collective on rank 0; rank 2 is further on
    ranks = [rank(0, 30, 30, proc_state="R"), rank(1, 31, 30), rank(2, 32, 31)]
    assert blamed(ranks) == [("RankHung", 0, "w0")]


def test_a_rank_that_never_reports_is_blamed_not_its_healthy_peer():
    ranks = [rank(0, 4, 3), rank(1, None, None, state="starting", progress_at=NOW - 5)]
    ranks[1].pop("first_step_at")
    assert blamed(ranks) == [("RankHung", 1, "w1")]
    assert "never reported collective progress" in hangs(ranks)[0].detail


def test_a_rank_its_agent_never_reported_is_blamed():
    silent = {
        "rank": 1,
        "worker": "w1",
        "coord": {"dp": 1, "pp": 0, "tp": 0},
        "local_rank": 0,
        "state": "assigned",
    }
    assert blamed([rank(0, 7, 6), silent]) == [("RankHung", 1, "w1")]


def test_all_frozen_at_the_same_count_is_a_job_stall():
    ranks = [rank(0, 25, 24), rank(1, 25, 24), rank(2, 25, 24)]
    out = hangs(ranks)
    assert [f.cause for f in out] == ["JobStalled"] and "all 3 ranks" in out[0].detail


def test_same_count_but_one_spins_while_the_others_sleep():
    ranks = [rank(0, 25, 24), rank(1, 25, 24, proc_state="R", busy=True), rank(2, 25, 24)]
    assert blamed(ranks) == [("RankHung", 1, "w1")]
    everyone_busy = [rank(n, 25, 24, proc_state="R", busy=True) for n in range(3)]
    assert [c for c, *_ in blamed(everyone_busy)] == ["JobStalled"]


def test_stopped_process_rule_still_comes_first():
    ranks = [rank(0, 25, 24), rank(1, 24, 24, proc_state="T")]
    out = hangs(ranks)
    assert [(f.rank, "stopped" in f.detail) for f in out] == [(1, True)]


def test_no_blame_before_the_hang_bound():
    ranks = [rank(0, 25, 24, progress_at=NOW - 1), rank(1, 24, 24, progress_at=NOW - 1)]
    assert hangs(ranks) == []


def test_out_of_memory_names_rank_worker_peak_and_fix():
    r = rank(1, 3, 3, state="failed")
    r.update(
        exit_code=-9,
        oom={"peak_rss": 812 * 2**20, "limit": 800 * 2**20, "evidence": "memory cgroup oom_kill"},
    )
    msg = health.out_of_memory(view([rank(0, 3, 3), r]))
    assert (
        "rank 1" in msg
        and "w1" in msg
        and "812 MiB" in msg
        and "800 MiB" in msg
        and "zero 3" in msg
    )
    plain_kill = {**r, "oom": None}
    assert health.out_of_memory(view([plain_kill])) is None


def test_counters_round_trip_through_the_shared_file(tmp_path):
    path = counters_path(tmp_path / "metrics-0.jsonl")
    c = Collectives(path)
    assert read_counters(path) == (0, 0)
    with c.phase():
        assert read_counters(path) == (1, 0)  # visible while the phase is still running
    assert read_counters(path) == (1, 1)
    with pytest.raises(RuntimeError):
        with c.phase():
            raise RuntimeError("collective failed")
    assert read_counters(path) == (2, 1)  # entered, never left
    assert read_counters(tmp_path / "absent") is None


BASE = {"name": "x", "model": {"preset": "tiny"}, "train": {"steps": 5, "global_batch": 8}}


def test_spec_fault_tolerance_fields():
    ft = parse_spec(BASE).fault_tolerance
    assert (ft.quarantine_s, ft.collateral_limit, ft.collateral_window_s) == (60.0, 3, 900.0)
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, "fault_tolerance": {"collateral_limit": 0, "quarantine_s": -1}})
    fields = {p.field for p in e.value.problems}
    assert fields == {"fault_tolerance.collateral_limit", "fault_tolerance.quarantine_s"}
