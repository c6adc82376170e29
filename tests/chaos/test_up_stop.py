"""`meshkeeper up` stopped mid-job and started again on its run dir (cli/stop_and_resume.py):
the stop suspends the job at a committed step before anything exits, the next `up` resumes
it, and it finishes with no restart counted and the loss of an uninterrupted run, bit for
bit, each step run once."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import assert_curve, mesh_spec, start, succeeded
from tests.chaos.conftest import UP_WORKERS

pytestmark = pytest.mark.slow

STEPS = 40
MIN_STEP_S = 0.25  # paced (chaos.min_step_s): the stop lands mid-run on any host


def test_up_stopped_mid_job_resumes_it_where_it_stopped(up, uninterrupted):
    spec = {**mesh_spec("up-stop", steps=STEPS), "chaos": {"min_step_s": MIN_STEP_S}}
    want = uninterrupted(spec)
    w, _ = start(up, spec)
    w.until(lambda j: j.step >= 4, 60, "a few steps")

    up.restart(UP_WORKERS)  # SIGTERM, as Ctrl-C or a service manager stops it
    log = up.log.read_text()
    assert f"suspended {w.jid}" in log and f"resumed {w.jid}" in log, up.logs()

    j = w.finish()
    succeeded(up, j)
    assert (j.generation, j.restarts, j.recoveries) == (2, 0, [])
    curve = assert_curve(up, j, want, exact=True)
    # generation 1 stopped at a step it committed, 2 went on from it: nothing redone
    stop = max(s for s, r in curve.items() if r["generation"] == 1)
    assert 4 < stop < STEPS
    assert {s: r["generation"] for s, r in curve.items()} == {
        s: 1 if s <= stop else 2 for s in range(1, STEPS + 1)
    }
    suspended = [e.message for e in up.client.events(j.id, limit=500) if e.reason == "Suspended"]
    assert suspended == [f"every rank committed step {stop} and stopped; resume continues from it"]
