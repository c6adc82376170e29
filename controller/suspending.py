"""Suspending a job and resuming it (docs/architecture.md, "Suspend and resume").

The API only sets `suspend_requested`; the pass enacts it. A pending job is suspended at
once. A running one is drained: the pass picks the step every rank stops after, far enough
past the furthest one reported that each agent hears of it before its ranks get there, and
writes it into each rank worker's pointer; every trainer commits that step and exits
`EXIT_SUSPENDED` (worker/trainer/drain.py). Once every rank has, the job releases its
workers and is Suspended. Ranks that have not stopped within the spec's
`preemption.grace_s` are stopped, and the job resumes from its previous commit.

Resuming clears the request: the job queues as a pending one and its next generation is
placed like any start, restoring the committed step (no restart is counted, nothing is
re-planned). Bit for bit the run it would have been: resume on the same mesh is exact.
"""

from __future__ import annotations

import math

from controller import apply, history
from controller.jobs import Job
from controller.passes import JobView, Pass
from services.store import Tx

# how far ahead of the furthest rank the stop step lies: at least this many steps, and at
# least this long at the job's step time (an agent hears of it within a pass and a beat)
STEPS_AHEAD = 2
AHEAD_S = 3.0
PACE_POINTS = 21  # history points (about one a step) the pace is measured over


def suspend_waiting(ctx: Pass, job: Job) -> None:
    """A job that holds no workers (pending) is suspended in place."""
    message = "suspended on request before it was placed; resume to queue it again"
    job.set("Running", False, "Suspended", message, ctx.now)
    job.set("Suspended", True, "Suspended", message, ctx.now)
    _write(ctx, job, "Suspended", message)


def resume(ctx: Pass, job: Job) -> None:
    """Suspended -> Pending: the queue places it like any waiting job."""
    message = "resumed on request; it restores its last commit once placed"
    job.set("Suspended", False, "Resumed", message, ctx.now)
    job.set("Running", False, "Resumed", message, ctx.now)
    _write(ctx, job, "Resumed", message)


def drain(ctx: Pass, view: JobView) -> bool:
    """One pass of a running job being suspended or preempted (`preempted_by`); True when
    this pass wrote its outcome (the stop step was just issued, or the job stopped)."""
    job = view.job
    issued = job.drain if job.drain.get("generation") == job.generation else {}
    if view.ranks and all(r.state == "suspended" for r in view.ranks):
        _stopped(ctx, view, f"every rank committed step {issued.get('step')} and stopped")
        return True
    if not issued:
        if not (job.suspend_requested or job.preempted_by) or job.phase != "Running":
            return False  # not asked, or recovering: a new generation is asked once it runs
        return _issue(ctx, view)
    grace = job.spec.preemption.grace_s
    if ctx.now - issued["at"] > grace:
        _stopped(
            ctx,
            view,
            f"the ranks did not commit step {issued['step']} within preemption.grace_s "
            f"({grace:g} s) and were stopped",
        )
        return True
    return False


def _stopped(ctx: Pass, view: JobView, what: str) -> None:
    """Suspended (a person asked), or queued again (a higher-priority job did)."""
    job = view.job
    if job.suspend_requested or not job.preempted_by:
        apply.suspended(ctx, view, f"{what}; resume continues from its last commit")
    else:
        apply.preempted(
            ctx,
            view,
            f"preempted by {job.preempted_by}: {what}; it queues again and continues from its "
            "last commit",
        )


def _issue(ctx: Pass, view: JobView) -> bool:
    job = view.job
    wall = _seconds_per_step(ctx, job)
    if wall is None:
        return False  # no pace to measure the margin in yet: after a few steps
    furthest = max((r.step for r in view.ranks), default=job.step)
    step = furthest + max(STEPS_AHEAD, math.ceil(AHEAD_S / wall))
    if step >= job.total_steps:
        return False  # it finishes before it could stop: the request ends with the job
    job.drain = {"generation": job.generation, "step": step, "at": ctx.now}
    tx = Tx()
    for wid in sorted(view.asg.rank_workers):
        tx.hset(ctx.keys.worker_assignment(wid), {"drain_step": step})
        tx.publish(ctx.keys.worker_assignment(wid), job.id)
    _write(ctx, job, "Suspending", f"every rank stops after step {step}, commits it and exits", tx)
    return True


def _seconds_per_step(ctx: Pass, job: Job) -> float | None:
    """Wall seconds per step of the current generation over its newest history points (the
    pace, with data loading, saves and evals: a step record's step_s is its compute alone)."""
    points = [
        p for p in history.recent(ctx.store, job.id, PACE_POINTS) if p.generation == job.generation
    ]
    if len(points) < 2 or points[0].step == points[-1].step:
        return None
    return (points[0].time - points[-1].time) / (points[0].step - points[-1].step)


def _write(ctx: Pass, job: Job, reason: str, message: str, tx: Tx | None = None) -> None:
    tx = (tx or Tx()).hset(ctx.keys.job(job.id), job.fields())
    tx.event(ctx.keys.job_events(job.id), ctx.event("Normal", reason, message, job.generation))
    ctx.commit(tx)
