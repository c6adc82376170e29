"""Following a running job: read its ranks, let fault handling decide, write the outcome."""

from __future__ import annotations

from controller import apply, faults, goodput, suspending
from controller.availability import RedisAvailability
from controller.jobs import Job
from controller.passes import JobView, Pass
from controller.ranks import rank_view
from services import assignment
from services.store import Tx


def follow(ctx: Pass, job: Job, availability: RedisAvailability) -> None:
    asg = assignment.current(ctx.store, job.id, job.generation)
    if asg is None:
        return  # being rewritten; next pass
    # Each job is judged at a server time read with its beats: a pass that wrote a big
    # recovery before reaching this job must not age its beats by that long (issue 15).
    ctx.now, seen = ctx.store.beats(asg.workers)
    progress = ctx.store.progress(asg.workers)
    dead_after = job.spec.fault_tolerance.dead_after_s
    # Silence (heartbeat age, frozen progress) counts only if Redis could take the agents'
    # reports all along: after a stall or restart of Redis, or a gap in our own access to
    # it, nothing is judged until it has been available for a full dead_after_s again
    # (controller/availability.py). Asked after the reads above, so a stall that ended just
    # before them is still an open gap if the watcher has not yet recorded it.
    judge = seen if availability.steady(dead_after) else None
    alive = {w for w, t in seen.items() if ctx.now - t <= dead_after} if judge is not None else None
    view = JobView(job, asg, rank_view(asg, progress, alive))
    goodput.account(job, ctx.now, view.ranks, seen)
    if all(r.state == "succeeded" for r in view.ranks):
        # A generation can train to its end unwatched (its controller killed mid-recovery,
        # the next one taking the lease later): its recovery is completed in the same write,
        # so no finished job keeps an open record.
        tx = Tx()
        if done := faults.complete(job, view.ranks, ctx.now):
            apply.note(ctx, view, done, tx)
        apply.finish(
            ctx,
            view,
            "Succeeded",
            "AllRanksSucceeded",
            f"{len(view.ranks)} ranks finished {job.total_steps} steps",
            tx=tx,
        )
        return
    if suspending.drain(ctx, view):
        return
    decision = faults.decide(ctx, view, judge)
    if decision is not None and apply.enact(ctx, view, decision):
        return
    tx = Tx()
    if decision is not None:
        apply.note(ctx, view, decision, tx)
    apply.progress(ctx, view, tx, changed=decision is not None)
