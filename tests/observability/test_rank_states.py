"""`meshkeeper_ranks{state="straggler"}`: a running rank the controller flagged as a straggler
in the job's current generation (reported, not replaced) counts as one; a flag from an older
generation, or on a rank that is no longer running, does not."""

from __future__ import annotations

from controller.jobs import Job
from controller.metrics_jobs import rank_state


def job(flagged: dict, generation: int = 2) -> Job:
    return Job(id="j", name="j", spec={}, generation=generation, flagged=flagged)


def test_a_flagged_running_rank_is_a_straggler_in_its_generation_only():
    running = {"rank": 3, "state": "running"}
    assert rank_state(running, job({"rank": 3, "worker": "w3", "generation": 2})) == "straggler"
    assert rank_state(running, job({"rank": 3, "worker": "w3", "generation": 1})) == "running"
    assert rank_state(running, job({"rank": 1, "worker": "w1", "generation": 2})) == "running"
    assert rank_state({"rank": 3, "state": "failed"}, job({"rank": 3, "generation": 2})) == "failed"
    assert rank_state(running, job({})) == "running"
