"""Suspend and resume (docs/architecture.md, "Suspend and resume"), through REST as its owner
uses it, on the session's stack: real agents, real trainers, real Redis.

A running job told to suspend stops every rank after one step, commits that step and frees
its workers (phase Suspended, no worker assigned); resumed, it trains on from that step and
ends with the loss curve of an uninterrupted run, bit for bit, with no restart counted and no
step redone.
"""

from __future__ import annotations

import pytest

from services.client import ApiError
from tests.chaos.chaos import paced_spec, resumed_once, start
from tests.stack import wait_until

pytestmark = pytest.mark.slow


def test_a_suspended_job_frees_its_workers_and_resumes_to_the_exact_loss(stack, uninterrupted):
    spec = paced_spec("suspend")
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    workers = {r.worker for r in j1.mesh.ranks} | set(j1.mesh.spares)
    w.until(lambda j: j.step >= 4, 60, "a few steps")

    accepted = stack.client.suspend(j1.id)
    assert accepted.suspend_requested and accepted.phase == "Running"
    held = w.until(lambda j: j.phase == "Suspended", 90, "the job to suspend")
    stop = held.last_checkpoint.step
    assert held.step == stop and 4 < stop < held.steps, (held.step, held.last_checkpoint)
    assert all(r.state == "suspended" and r.exit_code == 6 for r in held.mesh.ranks), held.mesh
    assert (held.generation, held.restarts) == (1, 0)
    reasons = [e.reason for e in stack.client.events(j1.id, limit=500)]
    assert "Suspending" in reasons and "Suspended" in reasons, reasons
    # its workers are free: none of them still names the job
    wait_until(
        lambda: all(stack.store.worker_assignment(wid).get("job") != j1.id for wid in workers),
        10,
        "the suspended job's workers released",
    )
    assert stack.client.suspend(j1.id).suspend_requested  # again: nothing changes
    assert stack.client.job(j1.id).phase == "Suspended"

    assert not stack.client.resume(j1.id).suspend_requested
    with pytest.raises(ApiError, match="not suspended; nothing to resume") as refused:
        stack.client.resume(j1.id)
    assert refused.value.status == 409

    assert resumed_once(stack, w.finish(), want) == stop
