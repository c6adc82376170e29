"""The scheduler's writes: each decision of a pass becomes one fenced transaction
(docs/architecture.md, "Generation and fencing"), so a controller that lost the lease
mid-pass changes nothing. Decisions come from controller/faults.py (running jobs) and from
the scheduler itself (placing, waiting, cancelling).
"""

from __future__ import annotations

import logging
import random

from controller import goodput, history, quarantine
from controller.decisions import (
    Complete,
    Decision,
    Finish,
    FlagStraggler,
    Grow,
    Recover,
    SetGrowAfter,
    WaitForCapacity,
)
from controller.faults import registered, registered_host
from controller.jobs import Job
from controller.passes import JobView, Pass
from controller.ranks import summarize
from controller.recovery import Layout
from services.api import RankStatus
from services.assignment import FINAL_RANK_STATES, Assignment
from services.buddies import pick_holders, restore_sources
from services.records import HistoryPoint, RecoveryRecord
from services.store import Tx

log = logging.getLogger("meshkeeper.scheduler")
KEEP_RECORDS = 50  # recoveries kept on the job, newest last
# A job's store keeps every generation's rendezvous keys (a TCPStore lists none, so none can be
# dropped by generation): a new store on a fresh port after this many bounds what it holds.
STORE_GENERATIONS = 16


def enact(ctx: Pass, view: JobView, d: Decision) -> bool:
    """Write `d` if it starts, stops or ends a generation; True when it did. Other decisions
    only change the job's record: `note` them, and `progress` writes them."""
    job = view.job
    if isinstance(d, Finish):
        if d.restart:  # the fault that reached max_restarts counts as one
            job.restarts += 1
        finish(ctx, view, d.outcome, d.reason, d.message, d.blame)
    elif isinstance(d, Recover):
        job.restarts += 1
        ctx.pool.take(d.layout.moved.values())
        _next_generation(ctx, view, d.layout, d.record, d.reason, d.message, "Warning", d.blame)
    elif isinstance(d, Grow):
        ctx.pool.take(r.wid for r in d.layout.ranks)
        _next_generation(
            ctx, view, d.layout, d.record, d.reason, d.message, "Normal", quarantine.Blame()
        )
    elif isinstance(d, WaitForCapacity):
        job.restarts += 1
        _stop_for_capacity(ctx, view, d)
    else:
        return False
    return True


def note(ctx: Pass, view: JobView, d: Decision, tx: Tx) -> None:
    """Apply a decision that keeps the generation to the job record, its event to `tx`."""
    job = view.job
    if isinstance(d, Complete):
        job.recoveries[-1] = d.record
        job.set("Recovering", False, "Recovered", d.message, ctx.now)
        job.set("Running", True, "Training", _training(job, view.ranks), ctx.now)
        tx.event(
            ctx.keys.job_events(job.id), ctx.event("Normal", "Recovered", d.message, job.generation)
        )
        log.info("job %s: %s", job.id, d.message)
    elif isinstance(d, FlagStraggler):
        job.straggler = d.flag
        tx.event(
            ctx.keys.job_events(job.id),
            ctx.event("Warning", "StragglerDetected", d.message, job.generation),
        )
    elif isinstance(d, SetGrowAfter):
        if d.step is None:
            job.current.pop("grow_after", None)
        else:
            job.current["grow_after"] = d.step
    else:
        raise TypeError(f"{type(d).__name__} changes the generation: enact it")


def progress(ctx: Pass, view: JobView, tx: Tx, changed: bool) -> None:
    """The job's step, loss and speed from its ranks, `Training` once every rank trains,
    and whatever `tx` holds already: one transaction, written if anything changed (`changed`:
    the caller changed the record already, e.g. by `note`)."""
    job = view.job
    changed = _absorb(ctx, job, view.ranks, tx) or changed
    if job.step > 0 and not job.open_recovery and all(r.state == "running" for r in view.ranks):
        changed = (
            job.set("Running", True, "Training", _training(job, view.ranks), ctx.now) or changed
        )
    if changed:
        ctx.commit(tx.hset(ctx.keys.job(job.id), job.fields()))


def _training(job: Job, ranks: list[RankStatus]) -> str:
    return f"generation {job.generation}: all {len(ranks)} ranks training"


def _absorb(ctx: Pass, job: Job, ranks: list[RankStatus], tx: Tx) -> bool:
    """Take the ranks' progress into the job; a step that advanced adds a history point
    (controller/history.py) to `tx`, the transaction that writes the step."""
    before = _progress(job)
    job.absorb(summarize(ranks))
    if job.step > before[0]:
        history.append(
            tx,
            ctx.keys,
            job.id,
            HistoryPoint(
                step=job.step,
                time=ctx.now,
                loss=job.loss,
                tokens_per_s=job.tokens_per_s,
                step_s=job.step_s,
                generation=job.generation,
                eval_loss=job.eval_loss,
                eval_step=job.eval_step,
            ),
        )
    return _progress(job) != before


def _progress(job: Job) -> tuple:
    """What `Job.absorb` may change."""
    return (
        job.step,
        job.loss,
        job.tokens_per_s,
        job.step_s,
        job.epoch,
        job.eval_loss,
        job.eval_step,
    )


# -- generations ----------------------------------------------------------------------
def start_generation(
    ctx: Pass,
    job: Job,
    layout: Layout,
    old: Assignment | None,
    reason: str,
    tx: Tx,
    *,
    tp_split: bool = False,
    event: tuple[str, str, str] | None = None,
    store_served: bool = False,
) -> Assignment:
    """Add generation+1 to `tx`: the assignment, every worker's pointer, and the release of
    workers of `old` that the new generation no longer uses. Agents of a superseded
    generation stop their trainers; the new generation's own key space in the job's store
    fences out any that still run (`job_store`). `store_served`: some rank of `old` met on
    its store, so it works and may be kept.

    With snapshots on, the assignment names each rank's snapshot holder and, after a recovery
    (`old` given) that kept the mesh, where each rank's state from `old` lives
    (docs/architecture.md, "Hot recovery")."""
    k = ctx.keys
    wids = list(dict.fromkeys([r.wid for r in layout.ranks] + layout.spares))
    infos = registered(ctx, wids)
    gen = job.generation + 1
    master, port, store_wid, store_since = job_store(
        ctx, layout, old if store_served else None, gen, infos
    )
    p = job.spec.parallel
    reshaped = (layout.shape.dp, layout.shape.pp, layout.shape.tp) != (p.dp, p.pp, p.tp)
    snap = job.spec.snapshot
    host_of = {w: registered_host(infos[w]) for w in wids}
    buddies = (
        pick_holders(layout.ranks, layout.shape, host_of) if snap.enabled and snap.buddy else {}
    )
    sources = restore_sources(old, layout.ranks, layout.shape) if snap.enabled and old else None
    asg = Assignment(
        job.id,
        gen,
        layout.shape,
        master,
        port,
        layout.ranks,
        layout.spares,
        tp_split,
        layout.microbatches if reshaped else None,
        buddies,
        old.generation if sources is not None else None,
        sources,
        dp_labels(old, layout),
        store_wid,
        store_since,
    )
    job.generation = gen
    job.current = (
        {
            "dp": layout.shape.dp,
            "pp": layout.shape.pp,
            "tp": layout.shape.tp,
            "microbatches": layout.microbatches,
        }
        if reshaped
        else {}
    )
    where = _where(asg)
    job.set(
        "Running",
        True,
        reason,
        f"generation {gen} placed on {where}; rendezvous {asg.master_addr}:{asg.master_port}",
        ctx.now,
    )
    tx.hset(k.job(job.id), job.fields())
    if old is not None and old.shape == asg.shape:  # only what changed (issue 48)
        fields, cleared = asg.changes_from(old)
        tx.hset(k.job_assignment(job.id), fields).hdel(k.job_assignment(job.id), *cleared)
    else:
        tx.delete(k.job_assignment(job.id)).hset(k.job_assignment(job.id), asg.to_fields())
    # The job's agents follow its assignment channel; a pointer (job, role) is written only
    # for a worker whose job or role changes, so a recovery writes what it changed, not the
    # world's pointers (issue 48).
    tx.publish(k.job_assignment(job.id), str(gen))
    held = set(old.workers) if old else set()
    for wid in asg.workers:
        role = _role(asg, wid)
        if wid in held and role == _role(old, wid):
            continue  # its pointer names this job and role already
        tx.delete(k.worker_assignment(wid))
        tx.hset(k.worker_assignment(wid), {"job": job.id, "role": role})
        tx.publish(k.worker_assignment(wid), job.id)
        if wid not in held:  # the others hold the grant already
            tx.assigned[wid] = job.id
    kept = set(asg.workers)
    for wid in old.workers if old else []:
        if wid not in kept:
            _release(ctx, tx, job.id, wid)
    kind, why, msg = event or (
        "Normal",
        "Placed",
        f"generation {gen} on {where}"
        + (" (a TP group spans hosts: no host had room for it)" if tp_split else ""),
    )
    tx.event(k.job_events(job.id), ctx.event(kind, why, msg, gen))
    return asg


def _role(asg: Assignment, wid: str) -> str:
    return "rank" if wid in asg.rank_workers else "spare"


def dp_labels(old: Assignment | None, layout: Layout) -> list[int] | None:
    """The submitted dp index of each replica of `layout`, carried over from `old`: a replica
    is the one whose ranks' workers and slots it kept (a shrink keeps them and renumbers the
    replicas after a dropped one); with as many replicas as before, the same (a replacement
    keeps every coordinate); a replica new to the job takes the lowest label unused (a grow).
    None (0, 1, ...) for a first placement or a re-planned pp or tp: a new layout altogether."""
    if old is None or old.shape.pp != layout.shape.pp or old.shape.tp != layout.shape.tp:
        return None
    if layout.moved and layout.shape == old.shape:
        # a replacement keeps every coordinate, and moves ranks only onto workers the old
        # world's ranks did not use: each replica keeps its label (what the general case
        # below finds too, at a pass over the world: a 16,384-rank recovery's)
        return old.dp_labels
    old_labels = old.labels
    was = {(r.wid, r.local_rank, r.coord.pp, r.coord.tp): old_labels[r.coord.dp] for r in old.ranks}
    found: dict[int, int] = {}
    taken: set[int] = set()  # found's labels: a set, as a 16k-replica recovery asks per rank
    for r in layout.ranks:
        label = was.get((r.wid, r.local_rank, r.coord.pp, r.coord.tp))
        if label is not None and label not in taken and r.coord.dp not in found:
            found[r.coord.dp] = label
            taken.add(label)
    if layout.shape.dp == old.shape.dp:
        found = dict(enumerate(old.labels)) | found
    free = iter(sorted(set(range(layout.shape.dp + len(old.labels))) - set(found.values())))
    labels = [found[d] if d in found else next(free) for d in range(layout.shape.dp)]
    return None if labels == list(range(layout.shape.dp)) else labels


def _where(asg: Assignment) -> str:
    return f"{len(asg.rank_workers)} workers" + (
        f" + {len(asg.spares)} spares" if asg.spares else ""
    )


def job_store(
    ctx: Pass, layout: Layout, old: Assignment | None, gen: int, infos: dict[str, dict]
) -> tuple[str, int, str, int]:
    """Where generation `gen` rendezvouses: (address, port, the worker whose agent hosts the
    store, the generation its store started at). The store of `old` is kept while its worker
    still runs ranks and for at most STORE_GENERATIONS generations; else the store moves to
    rank 0's worker, on a fresh port."""
    if (
        old is not None
        and any(r.wid == old.store_wid for r in layout.ranks)
        and old.store_since is not None
        and gen - old.store_since < STORE_GENERATIONS
    ):
        return old.master_addr, old.master_port, old.store_wid, old.store_since
    wid = layout.ranks[0].wid
    master = infos[wid].get("address", "127.0.0.1")
    return master, pick_port(ctx, master), wid, gen


def pick_port(ctx: Pass, master: str) -> int:
    """A fresh rendezvous port, not one an open job on the same host uses."""
    used = set()
    for jid in ctx.store.job_ids(open_only=True):
        addr, port = ctx.store.rendezvous(jid)
        if addr == master:
            used.add(port)
    lo, hi = ctx.cfg.rdzv_ports
    while True:
        port = random.randrange(lo, hi)
        if port not in used:
            return port


def _release(ctx: Pass, tx: Tx, jid: str, wid: str) -> None:
    """Drop `wid`'s pointer if it still names `jid`, and wake its agent."""
    tx.delete_if(ctx.keys.worker_assignment(wid), "job", jid)
    tx.publish(ctx.keys.worker_assignment(wid), jid)
    tx.released[wid] = jid


def _from_layout(record: RecoveryRecord, asg: Assignment | None) -> None:
    """The layout the record's fault struck, for the page to keep drawing until the new
    generation trains (the new assignment replaces it)."""
    if asg is not None:
        record.from_shape = [asg.shape.dp, asg.shape.pp, asg.shape.tp]
        record.from_dp_labels = asg.labels


def _keep(job: Job, record: RecoveryRecord) -> None:
    job.recoveries = (job.recoveries + [record])[-KEEP_RECORDS:]


def _next_generation(
    ctx: Pass,
    view: JobView,
    layout: Layout,
    record: RecoveryRecord,
    reason: str,
    msg: str,
    kind: str,
    blame: quarantine.Blame,
) -> None:
    """Record the recovery and write its generation (and the blame), in one transaction."""
    job = view.job
    record.to_generation = job.generation + 1
    _from_layout(record, view.asg)
    _keep(job, record)
    job.set("Recovering", True, reason, msg, ctx.now)
    tx = Tx()
    quarantine.write(tx, ctx, job.id, job.generation, blame)
    event = "RecoveryStarted" if kind == "Warning" else reason
    start_generation(
        ctx,
        job,
        layout,
        view.asg,
        "Recovering",
        tx,
        event=(kind, event, msg),
        store_served=any(r.rendezvous_at is not None for r in view.ranks),
    )
    # decided once the new generation is computed, so decide_s includes that work (it grows
    # with the job: bench/scale.py); the record is written with the generation, in one commit
    record.decided_at = ctx.store.now()
    tx.hset(ctx.keys.job(job.id), job.fields())
    ctx.commit(tx)
    log.log(logging.WARNING if kind == "Warning" else logging.INFO, "job %s: %s", job.id, msg)
    _blamed_left(ctx, job.id, record, {r.wid for r in layout.ranks} | set(layout.spares))


def _blamed_left(ctx: Pass, jid: str, record: RecoveryRecord, staying: set[str]) -> None:
    """Tell the cluster about each worker a fault named that leaves the job (a rank whose
    trainer died but whose agent stays, as a spare, is not one): Kubernetes replaces its pod."""
    if ctx.actions is None:
        return
    left = {f.worker: f"{f.cause}: {f.detail}" for f in record.faults if f.worker}
    for wid, why in left.items():
        if wid not in staying:
            ctx.actions.worker_left(wid, jid, why)


def _stop_for_capacity(ctx: Pass, view: JobView, d: WaitForCapacity) -> None:
    """Stop the generation and release its workers; the scheduler places the job again (at
    its current dp) as soon as they fit."""
    job = view.job
    _from_layout(d.record, view.asg)
    _keep(job, d.record)
    job.set("Recovering", True, "WaitingForCapacity", d.message, ctx.now)
    job.set("Running", False, "WaitingForCapacity", d.message, ctx.now)
    tx = Tx()
    quarantine.write(tx, ctx, job.id, job.generation, d.blame)
    tx.hset(ctx.keys.job(job.id), job.fields())
    for wid in view.asg.workers:
        _release(ctx, tx, job.id, wid)
    tx.event(
        ctx.keys.job_events(job.id),
        ctx.event("Warning", "WaitingForCapacity", d.message, job.generation),
    )
    ctx.commit(tx)
    log.warning("job %s: %s", job.id, d.message)
    _blamed_left(ctx, job.id, d.record, set())


# -- endings and waits ----------------------------------------------------------------
def finish(
    ctx: Pass,
    view: JobView,
    outcome: str,
    reason: str,
    message: str,
    blame: quarantine.Blame | None = None,
    tx: Tx | None = None,
) -> None:
    """Terminal state, the final rank view kept on the job, and every worker released;
    written with whatever `tx` holds already."""
    job, tx = view.job, tx if tx is not None else Tx()
    job.finished_at = ctx.now
    if blame is not None:
        quarantine.write(tx, ctx, job.id, job.generation, blame)
    tx.zrem(ctx.keys.jobs_open(), job.id)
    tx.zadd(ctx.keys.jobs_finished(), job.id, ctx.now)  # controller/retention.py's clock
    kind = "Normal" if outcome == "Succeeded" else "Warning"
    _stop(ctx, view, outcome, reason, message, kind, tx)


def suspended(ctx: Pass, view: JobView, message: str) -> None:
    """The job holds no workers until resumed (controller/suspending.py): the final rank view
    kept and every worker released, as at the end, but it stays in the open queue."""
    view.job.drain, view.job.preempted_by = {}, None
    _stop(ctx, view, "Suspended", "Suspended", message, "Normal", Tx())


def preempted(ctx: Pass, view: JobView, message: str) -> None:
    """As `suspended`, but the job queues again at once (Pending) under a `Preempted`
    condition: the queue places it after the higher-valued job it stopped for. It keeps
    `preempted_by` until it is placed again (controller/placing.py), so that job waits for
    the workers it freed instead of stopping more jobs meanwhile (unless another job took
    them: controller/preempting.py)."""
    view.job.drain = {}
    _stop(ctx, view, "Preempted", "Preempted", message, "Warning", Tx())


def _stop(
    ctx: Pass, view: JobView, outcome: str, reason: str, message: str, kind: str, tx: Tx
) -> None:
    """Condition `outcome` set and Running unset, the ranks' last progress and final view
    kept on the job, every worker released and an event; written with whatever `tx` holds."""
    job = view.job
    goodput.stopped(job, ctx.now, view.ranks)
    _absorb(ctx, job, view.ranks, tx)
    # ranks still going are being stopped by this very transaction
    job.final_ranks = [
        r if r.state in FINAL_RANK_STATES else r.model_copy(update={"state": "stopped"})
        for r in view.ranks
    ]
    job.set("Running", False, reason, message, ctx.now)
    job.set(outcome, True, reason, message, ctx.now)
    tx.hset(ctx.keys.job(job.id), job.fields())
    for wid in view.asg.workers if view.asg else []:
        _release(ctx, tx, job.id, wid)
    tx.event(ctx.keys.job_events(job.id), ctx.event(kind, reason, message, job.generation))
    ctx.commit(tx)
    log.info("job %s: %s (%s) %s", job.id, outcome, reason, message)


def drop_unreadable(ctx: Pass, jid: str) -> None:
    """A job record that does not parse (controller/jobs.py `from_hash`) leaves the queue,
    and the workers its last assignment names, where that parses, are released: no pass
    could end the job and free them otherwise."""
    tx = Tx().zrem(ctx.keys.jobs_open(), jid)
    asg = Assignment.from_fields(ctx.store.job_assignment(jid))
    for wid in asg.workers if asg else []:
        _release(ctx, tx, jid, wid)
    ctx.commit(tx)


def waiting(ctx: Pass, job: Job, reason: str, msg: str) -> None:
    """Mark a job that cannot start now (Running False with `reason`); an event when it
    starts waiting, not on every change of the count in the message."""
    was = (job.condition("Running") or {}).get("reason")
    if job.set("Running", False, reason, msg, ctx.now):
        tx = Tx().hset(ctx.keys.job(job.id), job.fields())
        if was != reason:
            tx.event(ctx.keys.job_events(job.id), ctx.event("Normal", reason, msg, job.generation))
        ctx.commit(tx)
