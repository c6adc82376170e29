"""Why a job that cannot start now waits: quotas, backfill order and the starvation bound
(docs/control-plane.md, "Scheduling")."""

from __future__ import annotations

from controller.admission import capacity_problems
from controller.apply import waiting
from controller.jobs import Job
from controller.passes import Pass


def running_ranks(jobs: list[Job]) -> dict[str | None, int]:
    """owner -> ranks of its jobs that hold workers now (what quotas count)."""
    out: dict[str | None, int] = {}
    for job in jobs:
        if job.phase in ("Running", "Recovering") and not job.awaiting_capacity:
            out[job.owner] = out.get(job.owner, 0) + job.ranks
    return out


def over_quota(ctx: Pass, job: Job, running: dict[str | None, int]) -> bool:
    """True (and the job marked WaitingForQuota) when starting it would put its owner over
    the quota; it waits without blocking anyone (a job larger than the whole quota was
    refused at submission)."""
    limit = ctx.cfg.quotas.limit(job.owner)
    used = running.get(job.owner, 0)
    if limit is None or used + job.ranks <= limit:
        return False
    waiting(
        ctx,
        job,
        "WaitingForQuota",
        f"needs {job.ranks} ranks; owner "
        f"{job.owner or 'anonymous'} runs {used} of its quota of {limit}",
    )
    return True


def fits_pool(ctx: Pass, job: Job) -> bool:
    """Whether the job would fit the live pool were every worker idle (admission's test).
    Judged once a pass per distinct job shape (what `capacity_problems` reads of the spec):
    a queue of a thousand alike jobs costs one judgement of a 16,384-worker pool, not one
    each."""
    key = job.spec.model_dump_json(include={"model", "parallel", "train", "fault_tolerance"})
    if key not in ctx.fits:
        ctx.fits[key] = bool(ctx.live()) and not capacity_problems(job.spec, ctx.live())
    return ctx.fits[key]


def reserves(ctx: Pass, job: Job) -> bool:
    """The starvation bound: a job that could run were workers freed, waiting for
    `reserve_after_s` since it last stopped running (or was submitted)."""
    since = (
        (job.condition("Running") or {}).get("lastTransitionTime") or job.submitted_at or ctx.now
    )
    return ctx.now - since >= ctx.cfg.reserve_after_s and fits_pool(ctx, job)


def wait(ctx: Pass, job: Job, reserved_by: str | None) -> None:
    spares = job.spec.fault_tolerance.spares
    free = ctx.pool.workers
    if reserved_by is not None and reserved_by != job.id:
        msg = (
            f"queued behind job {reserved_by}, which has waited over "
            f"{ctx.cfg.reserve_after_s:g}s and has first claim on freed workers"
        )
    else:
        msg = (
            f"needs {job.ranks} worker slots + {spares} spare workers; "
            f"{sum(w.slots for w in free)} slots on {len(free)} idle workers"
        )
        if reserved_by == job.id:
            msg += "; later jobs wait behind it (it has waited the longest)"
        elif not fits_pool(ctx, job):
            msg += "; more than the live pool holds even when idle: waiting for workers to join"
    waiting(ctx, job, "WaitingForCapacity", msg)
