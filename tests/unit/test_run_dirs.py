"""The agent keeps its newest run directories only (worker/agent/run_dirs.py)."""

from __future__ import annotations

import os

from worker.agent.run_dirs import prune_run_dirs


def make(jobs, job: str, gen: int, age_s: float):
    d = jobs / job / f"g{gen}"
    d.mkdir(parents=True)
    (d / "rank0.log").write_text("x")
    os.utime(d, (1e9 - age_s, 1e9 - age_s))
    return d


def test_keeps_the_newest_and_the_current_and_drops_emptied_job_dirs(tmp_path):
    jobs = tmp_path / "jobs"
    oldest = make(jobs, "a", 1, 300)
    older = make(jobs, "b", 1, 200)
    newer = make(jobs, "b", 2, 100)
    current = make(jobs, "c", 1, 400)  # oldest by time, but the one starting now
    gone = prune_run_dirs(jobs, 1, current)
    assert sorted(gone) == sorted([oldest, older])
    assert newer.exists() and current.exists()
    assert not (jobs / "a").exists()  # its only generation went: the job dir too
