"""Placing a waiting job: the idle workers of the pass and a job's start on them."""

from __future__ import annotations

import logging

from controller import goodput, quarantine
from controller.apply import start_generation
from controller.jobs import Job
from controller.passes import Pass
from controller.placement import FreeWorker, Placement, natural_key, place
from controller.recovery import Layout
from services import assignment
from services.mesh import MeshShape
from services.store import Store, Tx

log = logging.getLogger("meshkeeper.scheduler")


def free_workers(
    store: Store, alive_s: float, now: float, held: frozenset[str] = frozenset()
) -> list[FreeWorker]:
    """Alive workers whose agent is idle and that no job holds, in name order, without the
    quarantined; only workers the controller registered at join (`joined_at`): a name that
    is only in `workers:seen` (any agent may beat there) never gets a rank. Workers in
    `held` (`held_workers`) are not even read: on a busy pool of 16,384 the rest is a few."""
    alive = sorted((w for w in store.alive_workers(alive_s, now) if w not in held), key=natural_key)
    wids = quarantine.admissible(store, alive, now)
    infos, pointers = store.workers(wids), store.assignments(wids)
    return [
        _as_free(w, infos[w])
        for w in wids
        if infos[w].get("joined_at") and infos[w].get("state") == "idle" and not pointers[w]
    ]


def registered_workers(store: Store, wids: list[str], alive_s: float) -> list[FreeWorker]:
    """`wids` as placement sees a free worker, busy or not (the workers a preemption would
    free: controller/preempting.py); those alive and registered at a join only."""
    alive = set(store.alive_workers(alive_s))
    infos = store.workers(wids)
    return [_as_free(w, infos[w]) for w in wids if w in alive and infos[w].get("joined_at")]


def _as_free(wid: str, info: dict[str, str]) -> FreeWorker:
    return FreeWorker(
        wid, quarantine.node_of(info), info.get("address", "127.0.0.1"), int(info.get("devices", 1))
    )


def held_workers(store: Store, jobs: list[Job]) -> frozenset[str]:
    """The workers, ranks and spares, that running jobs' current assignments name: never
    free, whatever their agents say. A job waiting for capacity holds none (it released
    them); a job being rewritten counts on the pointers, which `free_workers` still reads."""
    out: set[str] = set()
    for job in jobs:
        if job.phase in ("Running", "Recovering") and not job.awaiting_capacity:
            if asg := assignment.current(store, job.id, job.generation):
                out.update(asg.workers)
    return frozenset(out)


def try_start(ctx: Pass, job: Job) -> Placement | None:
    """Start `job` on workers of the pass's pool (and take them), if they fit."""
    p = job.spec.parallel
    shape = MeshShape(job.dp, job.pp, job.tp, p.ep)  # after a shrink or re-plan: not the spec's
    placed = place(shape, job.spec.fault_tolerance.spares, ctx.pool.workers)
    if placed is None:
        return None
    job.started_at = job.started_at or ctx.now
    goodput.placed(job, ctx.now)  # before it stops being Pending (or Preempted)
    layout = Layout(shape, placed.ranks, job.microbatches or p.microbatches, {}, placed.spares)
    if (job.condition("Preempted") or {}).get("status") == "True":
        job.set("Preempted", False, "Placed", "placed again after its preemption", ctx.now)
    job.preempted_by = None
    rec = job.open_recovery  # a recovery that waited for capacity ends here
    if rec:
        rec.to_generation, rec.decided_at = job.generation + 1, ctx.now
    tx = Tx()
    asg = start_generation(ctx, job, layout, None, "Starting", tx, tp_split=placed.tp_split)
    ctx.commit(tx)
    ctx.pool.take(placed.workers)
    log.info(
        "job %s: generation %d on %d workers%s",
        job.id,
        asg.generation,
        len({r.wid for r in asg.ranks}),
        f" + {len(asg.spares)} spares" if asg.spares else "",
    )
    return placed
