"""Suspend and resume (docs/architecture.md, "Suspend and resume"), through REST as its owner
uses it, on the session's stack: real agents, real trainers, real Redis.

A running job told to suspend stops every rank after one step, commits that step and frees
its workers (phase Suspended, no worker assigned); resumed, it trains on from that step and
ends with the loss curve of an uninterrupted run, bit for bit, with no restart counted and no
step redone. A rank that cannot stop (SIGSTOPped) is stopped after `preemption.grace_s`, and
the job resumes from the commit it had.
"""

from __future__ import annotations

import signal

import pytest

from services.client import ApiError
from tests.chaos.chaos import (
    assert_curve,
    gone,
    kill,
    paced_spec,
    rank,
    resumed_once,
    start,
    succeeded,
)
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


def test_a_rank_that_never_stops_is_stopped_after_grace_s_and_resumes_from_its_commit(
    stack, uninterrupted
):
    """A trainer that cannot act on the request (SIGSTOPped) holds the stop step back: after
    `preemption.grace_s` the generation is stopped all the same, and the job resumes from the
    commit it had, the steps after it redone to the same losses."""
    spec = {**paced_spec("suspend-grace"), "preemption": {"grace_s": 4}}
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim = rank(j1, 1)
    w.until(lambda j: j.last_checkpoint and j.step >= 6, 60, "a commit and a few steps")
    kill(victim.pid, signal.SIGSTOP)
    try:
        stack.client.suspend(j1.id)
        held = w.until(lambda j: j.phase == "Suspended", 60, "preemption.grace_s to run out")
    finally:
        if not gone(victim.pid):
            kill(victim.pid, signal.SIGCONT)
    why = held.condition("Suspended").message
    assert "did not commit step" in why and "within preemption.grace_s (4 s)" in why, why
    assert (held.generation, held.restarts, held.recoveries) == (1, 0, [])
    wait_until(lambda: gone(victim.pid), 30, f"the stopped trainer {victim.pid} to be gone")
    committed = held.last_checkpoint.step

    stack.client.resume(j1.id)
    j = w.finish()
    succeeded(stack, j)
    assert (j.generation, j.restarts, j.recoveries) == (2, 0, [])
    curve = assert_curve(stack, j, want, exact=True)
    assert min(s for s, r in curve.items() if r["generation"] == 2) == committed + 1
