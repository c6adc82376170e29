"""A job's step, loss and speed come from one rank's report (controller/ranks.py `summarize`,
controller/jobs.py `Job.absorb`): the status never shows one step with another step's loss
(`make demo` once printed step 14 twice, with losses 4.0248 and 3.6848)."""

from __future__ import annotations

from controller.jobs import Job
from controller.ranks import Progress, summarize
from services.api import RankStatus
from services.spec import parse_spec

SPEC = parse_spec(
    {"name": "j", "model": {"preset": "tiny"}, "train": {"steps": 100, "global_batch": 2}}
)


def rank(n: int, step: int, loss: float | None, tps: float = 1000.0) -> RankStatus:
    return RankStatus(
        rank=n,
        state="running",
        step=step,
        loss=loss,
        tokens_per_s=tps,
        step_s=0.1 * (n + 1),
        coord={"dp": n, "pp": 0, "tp": 0},
        worker=f"w{n}",
        local_rank=0,
    )


def test_summary_is_the_slowest_ranks_report_whole():
    # rank 0 is a step ahead: its loss is step 15's, not step 14's
    ranks = [rank(0, 15, 3.6848, tps=1100.0), rank(1, 14, 4.0248, tps=900.0)]
    assert summarize(ranks) == Progress(step=14, loss=4.0248, tokens_per_s=900.0, step_s=0.2)


def test_summary_of_equal_steps_is_the_lowest_ranks():
    assert summarize([rank(1, 7, 2.5), rank(0, 7, 2.5, tps=5.0)]) == Progress(7, 2.5, 5.0, 0.1)


def test_no_ranks_no_summary():
    assert summarize([]) is None


def test_an_older_report_changes_nothing():
    job = Job(id="j", name="j", spec=SPEC, step=14, loss=4.0248, tokens_per_s=900.0, step_s=0.2)
    job.absorb(Progress(step=13, loss=3.9, tokens_per_s=1.0, step_s=9.0))
    assert (job.step, job.loss, job.tokens_per_s, job.step_s) == (14, 4.0248, 900.0, 0.2)


def test_a_newer_report_is_taken_whole():
    job = Job(id="j", name="j", spec=SPEC, step=14, loss=4.0248, tokens_per_s=900.0, step_s=0.2)
    job.absorb(Progress(step=15, loss=3.6848, tokens_per_s=1100.0, step_s=None))
    assert (job.step, job.loss, job.tokens_per_s, job.step_s) == (15, 3.6848, 1100.0, None)


def test_a_generation_that_has_not_trained_yet_keeps_the_stored_loss():
    # after a restore every rank reports the resumed step before its first loss
    job = Job(id="j", name="j", spec=SPEC, step=20, loss=3.1, tokens_per_s=900.0, step_s=0.2)
    job.absorb(Progress(step=20, loss=None, tokens_per_s=None, step_s=None))
    assert (job.step, job.loss, job.tokens_per_s, job.step_s) == (20, 3.1, 900.0, 0.2)


def test_a_generation_that_has_not_evaluated_yet_keeps_the_jobs_latest_eval():
    # after a restore, the ranks' reports carry no eval until their first one
    job = Job(id="j", name="j", spec=SPEC, step=20, loss=3.1, eval_loss=3.3, eval_step=20, epoch=1)
    job.absorb(Progress(step=21, loss=3.0, tokens_per_s=900.0, step_s=0.2))
    assert (job.step, job.eval_loss, job.eval_step, job.epoch) == (21, 3.3, 20, 1)
    job.absorb(Progress(22, 2.9, 900.0, 0.2, epoch=2, eval_loss=3.2, eval_step=22))
    assert (job.step, job.eval_loss, job.eval_step, job.epoch) == (22, 3.2, 22, 2)
