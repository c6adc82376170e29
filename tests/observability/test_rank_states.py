"""`meshkeeper_ranks{state="straggler"}`: a running rank the controller flagged as a straggler
in the job's current generation (reported, not replaced) counts as one; a flag from an older
generation, or on a rank that is no longer running, does not."""

from __future__ import annotations

from controller.jobs import Job
from controller.metrics_jobs import rank_state
from services.api import RankStatus
from services.records import StragglerFlag
from services.spec import parse_spec

SPEC = parse_spec(
    {"name": "j", "model": {"preset": "tiny"}, "train": {"steps": 10, "global_batch": 2}}
)


def job(flag: StragglerFlag | None, generation: int = 2) -> Job:
    return Job(id="j", name="j", spec=SPEC, generation=generation, straggler=flag)


def rank(n: int, state: str) -> RankStatus:
    return RankStatus(
        rank=n, state=state, coord={"dp": n, "pp": 0, "tp": 0}, worker=f"w{n}", local_rank=0
    )


def flag(n: int, generation: int) -> StragglerFlag:
    return StragglerFlag(rank=n, worker=f"w{n}", generation=generation)


def test_a_flagged_running_rank_is_a_straggler_in_its_generation_only():
    running = rank(3, "running")
    assert rank_state(running, job(flag(3, 2))) == "straggler"
    assert rank_state(running, job(flag(3, 1))) == "running"
    assert rank_state(running, job(flag(1, 2))) == "running"
    assert rank_state(rank(3, "failed"), job(flag(3, 2))) == "failed"
    assert rank_state(running, job(None)) == "running"
