"""A real job with validation (`eval: {every_steps: 2, batches: 1}`, synthetic data) on the
session's stack: its eval loss reaches the REST status (with its perplexity and the step it
was measured at), the history and the controller's /metrics while it runs, and rank 0's
TensorBoard run record holds every step once and every eval, the last one the status's; the
mesh page draws the evals as the loss chart's second series."""

from __future__ import annotations

import math

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services import api
from tests.observability.exposition import samples
from tests.stack import tiny_spec, wait_phase, wait_until

STEPS = 60
# the loss chart's steps and its eval series (null where a step had no eval), and the job line
PAGE = """const c = view.charts.loss; return c && {steps: Array.from(c.data[0]),
    evals: Array.from(c.data[2]), meta: document.getElementById('job-meta').textContent}"""


def test_a_jobs_eval_loss_reaches_status_history_metrics_and_its_run_record(obs, browser):
    spec = tiny_spec("obs-eval", train={"steps": STEPS}, eval={"every_steps": 2, "batches": 1})
    job = obs.client.submit(spec).id

    def eval_scraped():
        found = samples(obs.scrape_controller(), "meshkeeper_eval_loss", job_id=job)
        return found[0].value if found else None

    scraped = wait_until(eval_scraped, 120, "meshkeeper_eval_loss for the running job")
    assert 0 < scraped < 20  # a cross-entropy over the tiny model's vocabulary
    running = obs.client.job(job)
    assert running.eval_step is not None and running.eval_step % 2 == 0

    done = wait_phase(obs.client, job, ("Succeeded",), 300)
    assert done.eval_step == STEPS  # the last step always evaluates
    assert done.eval_perplexity == math.exp(done.eval_loss)
    r = obs.client.http.get(f"/v1/jobs/{job}/history", params={"max_points": 1000})
    points = api.JobHistory.model_validate(r.raise_for_status().json()).points
    assert {p.eval_step for p in points if p.eval_step is not None} <= set(range(2, STEPS + 1, 2))
    assert points[-1].eval_step == STEPS and points[-1].eval_loss == done.eval_loss

    ea = EventAccumulator(str(obs.checkpoint_dir(job, spec) / "tensorboard"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == list(range(1, STEPS + 1))
    evals = ea.Scalars("eval/loss")
    assert [e.step for e in evals] == list(range(2, STEPS + 1, 2))
    assert evals[-1].value == float(np.float32(done.eval_loss))

    browser.get(f"{obs.controller.url}/ui/#/jobs/{job}&token={obs.secrets.viewer_token}")
    page = wait_until(
        lambda: (p := browser.execute_script(PAGE)) and p["steps"][-1:] == [STEPS] and p,
        30,
        "the loss chart drawn to the last step",
    )
    drawn = {s: v for s, v in zip(page["steps"], page["evals"], strict=True) if v is not None}
    assert drawn == {p.eval_step: p.eval_loss for p in points if p.eval_step is not None}
    assert (
        f"eval loss {done.eval_loss:.4f} (perplexity {done.eval_perplexity:.2f}) " in page["meta"]
    )
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"the page logged errors: {errors}"
