"""Preemption (docs/control-plane.md, "Priorities and preemption"): a waiting job whose class
preempts, and that the idle workers cannot hold, stops lower-valued running jobs to run.

Victims are chosen fewest ranks first, then the lowest value, then the newest, and only as
many as make the job fit the idle workers plus theirs; when even every candidate would not
make it fit, none is touched. A victim gets `preempted_by` and stops as a suspended job does
(controller/suspending.py: it commits a step first, or is stopped past its
`preemption.grace_s`), then queues again, Pending with a `Preempted` condition naming the
job it stopped for; placed again, it continues from that commit. Never a job of equal or
higher value, never one already stopping (for this job or another: two preempting jobs
cannot take each other's victims), never a spare of a job that goes on running.
"""

from __future__ import annotations

import logging

from controller.jobs import Job
from controller.passes import Pass
from controller.placement import place
from controller.placing import registered_workers
from controller.priorities import PriorityClasses
from services import assignment
from services.mesh import MeshShape
from services.store import Tx

log = logging.getLogger("meshkeeper.scheduler")


def try_preempt(ctx: Pass, job: Job, jobs: list[Job], classes: PriorityClasses) -> bool:
    """True while `job` waits for victims to stop (chosen now or in an earlier pass)."""
    mine = classes.of(job.spec)
    if not mine.preempts:
        return False
    victims = [j for j in jobs if j.preempted_by == job.id]
    if any(j.phase in ("Running", "Recovering") for j in victims):
        return True  # still stopping: what they free is this job's
    if victims:
        return False  # they yielded: it starts once their agents are idle, or waits as any job
    candidates = sorted(
        (
            j
            for j in jobs
            if j.phase == "Running"
            and not (j.awaiting_capacity or j.preempted_by or j.suspend_requested)
            and classes.of(j.spec).value < mine.value
        ),
        key=lambda j: (j.ranks, classes.of(j.spec).value, -j.seq),
    )
    shape = MeshShape(job.dp, job.pp, job.tp, job.spec.parallel.ep)
    freed: list[str] = []
    chosen: list[Job] = []
    for victim in candidates:
        asg = assignment.current(ctx.store, victim.id, victim.generation)
        if asg is None:
            continue
        chosen.append(victim)
        freed += asg.workers
        workers = ctx.pool.workers + registered_workers(ctx.store, freed, ctx.cfg.worker_alive_s)
        if place(shape, job.spec.fault_tolerance.spares, workers) is not None:
            _mark(ctx, job, mine.name, chosen)
            return True
    return False


def _mark(ctx: Pass, job: Job, klass: str, victims: list[Job]) -> None:
    tx = Tx()
    for v in victims:
        v.preempted_by = job.id
        tx.hset(ctx.keys.job(v.id), v.fields())
        why = f"stopping to free its workers for {job.id} (priority class {klass})"
        tx.event(ctx.keys.job_events(v.id), ctx.event("Warning", "Preempting", why, v.generation))
    names = ", ".join(v.id for v in victims)
    why = f"stopping {names} (lower priority) to free the workers this job needs"
    job.set("Running", False, "Preempting", why, ctx.now)
    tx.hset(ctx.keys.job(job.id), job.fields())
    tx.event(ctx.keys.job_events(job.id), ctx.event("Normal", "Preempting", why, job.generation))
    ctx.commit(tx)
    log.info("job %s: preempting %s", job.id, names)
