"""cli/render.py: the validation loss, its perplexity and the epoch in `meshkeeper status JOB`,
`watch` and the final summary, only what the job has (the full path from the trainer's
records: tests/integration/test_eval_progress.py)."""

from __future__ import annotations

import math

from cli import render
from services import api
from services.records import perplexity

BASE = {
    "id": "j-1",
    "name": "j",
    "phase": "Running",
    "generation": 1,
    "restarts": 0,
    "step": 12,
    "steps": 100,
    "loss": 3.5,
    "tokens_per_s": 1000.0,
    "mesh_shape": {"dp": 1, "pp": 1, "tp": 1},
    "conditions": [],
    "mesh": {"shape": {"dp": 1, "pp": 1, "tp": 1}},
    "spec": {},
}


def status(**fields) -> api.JobStatus:
    return api.JobStatus.model_validate({**BASE, **fields})


def test_eval_and_epoch_are_shown_with_the_step_measured_at():
    j = status(eval_loss=2.0, eval_perplexity=math.exp(2.0), eval_step=10, epoch=3)
    shown = "eval loss 2.0000 (perplexity 7.39) at step 10  epoch 3"
    assert render.validation(j) == shown
    assert (
        render.progress_line(j) == f"step 12/100  loss 3.5000  {shown}  1,000 tok/s  ETA -  Running"
    )
    assert render.summary(j).plain.endswith(f"\n  {shown}")


def test_a_job_without_eval_or_epoch_reads_as_before():
    j = status()
    assert render.validation(j) == ""
    assert render.progress_line(j) == "step 12/100  loss 3.5000  1,000 tok/s  ETA -  Running"
    assert "eval" not in render.summary(j).plain and "epoch" not in render.summary(j).plain


def test_an_epoch_alone_and_a_perplexity_past_a_float():
    assert render.validation(status(epoch=0)) == "epoch 0"
    assert perplexity(800.0) is None  # exp(800) overflows: shown as unknown, not an error
    j = status(eval_loss=800.0, eval_perplexity=perplexity(800.0), eval_step=12)
    assert render.validation(j) == "eval loss 800.0000 (perplexity -) at step 12"
