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
from controller.placing import held_workers, registered_workers
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
    shape = MeshShape(job.dp, job.pp, job.tp, job.spec.parallel.ep)
    freed = _freed_and_untaken(ctx, victims, jobs)
    if victims and _fits(ctx, job, shape, freed):
        return False  # they yielded: it starts once their agents are idle, or waits as any job
    # Nothing stopped for it yet, or what its victims freed went elsewhere meanwhile (a job
    # of equal or higher value took it, or a worker died): without choosing again it would
    # wait behind the victims' `preempted_by` while lower-valued jobs kept the pool.
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
    chosen: list[Job] = []
    for victim in candidates:
        asg = assignment.current(ctx.store, victim.id, victim.generation)
        if asg is None:
            continue
        chosen.append(victim)
        freed += asg.workers
        if _fits(ctx, job, shape, freed):
            _mark(ctx, job, mine.name, chosen)
            return True
    return False


def _freed_and_untaken(ctx: Pass, victims: list[Job], jobs: list[Job]) -> list[str]:
    """The workers of the stopped victims' last generations that no running job holds now."""
    held = held_workers(ctx.store, jobs)
    out: list[str] = []
    for v in victims:
        if asg := assignment.current(ctx.store, v.id, v.generation):
            out += [w for w in asg.workers if w not in held and w not in out]
    return out


def _fits(ctx: Pass, job: Job, shape: MeshShape, freed: list[str]) -> bool:
    """`job` fits the idle workers plus `freed` (busy or not, registered and alive)."""
    idle = {w.wid for w in ctx.pool.workers}
    more = registered_workers(
        ctx.store, [w for w in freed if w not in idle], ctx.cfg.worker_alive_s
    )
    return place(shape, job.spec.fault_tolerance.spares, ctx.pool.workers + more) is not None


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
