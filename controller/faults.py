"""Fault handling for a running job: detect, and decide what to do (docs/architecture.md,
"Failure handling").

`decide` is called on every pass for every running job. It reads what it needs (the job,
its assignment and rank reports, the pass's pool, spares' heartbeats, a worker's strikes)
and returns a decision (controller/decisions.py); it writes nothing. The scheduler writes
the decision in one fenced transaction (controller/apply.py).

A recovery is one `RecoveryRecord` on the job: cause, faults, action, the workers moved,
steps lost, and the duration of each phase, filled in once every rank of the new generation
has trained its first step (`complete`):
    detect      fault (exit, last heartbeat, last progress) -> noticed here
    decide      noticed -> the new generation written
    rendezvous  written -> the slowest rank's process group formed
    restore     -> the slowest rank restored the checkpoint
    first_step  -> the slowest rank finished its first step
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from controller import aborts, health, quarantine, replan
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
from controller.jobs import Job
from controller.passes import JobView, Pass
from controller.placement import FreeWorker
from controller.quarantine import Blame
from controller.recovery import Layout, grow, replace_workers, shrink
from services.api import RankStatus
from services.assignment import Assignment
from services.records import FaultRecord, RecoveryRecord, StragglerFlag
from services.store import loads


def decide(ctx: Pass, view: JobView, seen: dict[str, float] | None) -> Decision | None:
    """What to do about a fault or returning capacity; None: nothing. `seen` None: Redis
    just restarted, so silence (heartbeats, progress) proves nothing yet."""
    job, ranks = view.job, view.ranks
    ft = job.spec.fault_tolerance
    oom = health.out_of_memory(ranks)
    if oom:  # before anything spends a spare: the spare would be killed the same way
        return Finish("Failed", "OutOfMemory", oom)
    repeats = health.deterministic_failure(ranks)
    if repeats:
        return Finish("Failed", *repeats)
    if health.corruption_pending(ranks, ft.hang_after_s, ctx.now):
        return None  # the other ranks are exiting with the same evidence: let them finish
    faults = (
        # before the rest: the other ranks' exits (code 4) are collateral of the corruption
        health.silent_corruption(ranks, ctx.now)
        or health.device_errors(ranks, ctx.now)
        or health.dead_or_killed(ranks, seen, ft.dead_after_s, ctx.now)
        or aborts.blame_after_aborts(ranks, ctx.now)
        or (
            health.hangs(ranks, ft.hang_after_s, ctx.now, job.spec.model.params)
            if seen is not None
            else []
        )
    )
    if not faults and aborts.settling(ranks, ctx.now):
        return None  # the live ranks' watchdogs are about to abort them, with their dumps
    faults = faults or health.collateral_only(ranks, ctx.now, seen)
    if faults:
        return job_fault(job, faults) or recover(ctx, view, faults)
    st = ft.straggler
    slow = health.straggler(ranks, st.slowdown, st.window_steps, ctx.now)
    if slow and (flagged := straggler(ctx, view, slow, st.action)):
        return flagged
    return complete(job, ranks, ctx.now) or grow_back(ctx, view)


# -- recovery -------------------------------------------------------------------------
def recover(ctx: Pass, view: JobView, faults: list[FaultRecord]) -> Decision:
    job, asg = view.job, view.asg
    ft = job.spec.fault_tolerance
    faults, strikes = collateral(ctx, job, faults)
    first = min(faults, key=lambda f: f.fault_at)
    blame = Blame(strikes, quarantine.quarantines(faults, ft.quarantine_s, ctx.now))
    record = new_record(job, view.ranks, first.cause, faults, ctx.now)
    record.quarantined = [q for q, _ in blame.quarantined]
    if job.restarts + 1 > ft.max_restarts:
        msg = (
            f"{first.detail} (rank {first.rank} on {first.worker}); {job.restarts} "
            f"restarts already, max_restarts is {ft.max_restarts}"
        )
        return Finish("Failed", "ReachedMaxRestarts", msg, restart=True, blame=blame)
    bad = {f.worker for f in faults if f.cause not in health.BLAMELESS + ("TrainerKilled",)}
    movable = movable_on_kill(asg, faults)
    layout, action = plan(ctx, job, asg, bad | movable)
    if movable and action != "replace":  # no spare for the killed ranks: restart them in place
        layout, action = plan(ctx, job, asg, bad)
    if layout is None:
        return wait_for_capacity(job, record, blame)
    # A worker whose trainer was killed but whose agent lives stays as a spare.
    alive_again = [
        f.worker for f in faults if f.cause == "TrainerKilled" and f.worker in layout.moved
    ]
    layout = Layout(
        layout.shape,
        layout.ranks,
        layout.microbatches,
        layout.moved,
        layout.spares + [w for w in alive_again if w not in layout.spares],
    )
    record.action = action
    record.replaced = [{"old": o, "new": n} for o, n in layout.moved.items()]
    record.to_shape = [layout.shape.dp, layout.shape.pp, layout.shape.tp]
    return Recover(layout, record, REASONS[action], _message(first, action, layout), blame)


def job_fault(job: Job, faults: list[FaultRecord]) -> Finish | None:
    """Fail the job when a device error repeats at the same rank and step on the worker that
    replaced the first one: two devices do not fail alike, the job's input (a token id past
    the vocabulary's device-side assert) does, and every spare would fail the same way."""
    last = job.recoveries[-1] if job.recoveries else None
    if last is None or last.cause != "DeviceError":
        return None
    before = {(f.rank, (f.evidence or {}).get("step")): f.worker for f in last.faults}
    for f in faults:
        where = (f.rank, (f.evidence or {}).get("step"))
        if f.cause == "DeviceError" and before.get(where) not in (None, f.worker):
            return Finish(
                "Failed",
                "DeviceErrorRepeated",
                f"rank {f.rank} failed with a device error during step {where[1]} on worker "
                f"{before[where]}, and again on {f.worker}, which replaced it: the job's own "
                f"input or model fails there, not a device ({f.detail}). Check the data at "
                "that step (token ids below model.vocab), then resubmit",
            )
    return None


def movable_on_kill(asg: Assignment, faults: list[FaultRecord]) -> set[str]:
    """The workers whose killed trainer moves to a spare: a kill blames no worker (its agent
    lives and reported the exit), so a worker holding one rank of the job moves only when a
    spare takes it (and stays with the job as a spare: the kill may come from its host, a
    person or an OOM killer outside the trainer's cgroup). A worker holding several ranks
    restarts them in place: moving it would throw away its healthy ranks' memory and need a
    whole free worker of its size (docs/architecture.md, "Failure handling")."""
    held = Counter(r.wid for r in asg.ranks)
    return {f.worker for f in faults if f.cause == "TrainerKilled" and held[f.worker] == 1}


REASONS = {
    "replace": "ReplacingRank",
    "shrink": "ShrinkingDP",
    "replan": "Replanning",
    "restart": "Restarting",
}


def plan(ctx: Pass, job: Job, asg: Assignment, bad: set[str]) -> tuple[Layout | None, str]:
    """The next generation's layout and its action; the workers it promotes from the pass's
    pool are `layout.moved`'s values (taken when the decision is written)."""
    p, t = job.spec.parallel, job.spec.train
    mb = asg.microbatches or p.microbatches
    host_of = hosts(ctx, asg.workers)
    spares = alive_spares(ctx, job, asg, bad, host_of)
    candidates = spares + [w for w in ctx.pool.workers if w.wid not in bad]
    keep = [w.wid for w in spares]
    layout = replace_workers(asg.shape, asg.ranks, mb, bad, candidates, keep, host_of)
    if layout is not None:
        return layout, "restart" if not bad else "replace"
    layout = shrink(
        asg.shape,
        asg.ranks,
        bad,
        job.spec.fault_tolerance.min_dp,
        t.global_batch,
        mb,
        p.pp_schedule == "interleaved_1f1b",
        host_of,
    )
    if layout is not None:
        return Layout(
            layout.shape, layout.ranks, layout.microbatches, {}, keep + layout.spares
        ), "shrink"
    layout = replanned(ctx, job, asg, bad, spares, host_of)
    return layout, "replan" if layout is not None else "wait"


def replanned(
    ctx: Pass,
    job: Job,
    asg: Assignment,
    bad: set[str],
    spares: list[FreeWorker],
    host_of: dict[str, str],
) -> Layout | None:
    """Another layout on the job's healthy workers, its ranks' first, then its live spares
    (controller/replan.py)."""
    healthy = own_workers(ctx, asg, bad, host_of) + spares
    infos = registered(ctx, [w.wid for w in healthy])
    return replan.replan(job.spec, healthy, replan.cluster_of(infos)) if healthy else None


def own_workers(
    ctx: Pass, asg: Assignment, bad: set[str], host_of: dict[str, str]
) -> list[FreeWorker]:
    """The workers the job's ranks run on, but `bad`, in rank order."""
    mine = [w for w in dict.fromkeys(r.wid for r in asg.ranks) if w not in bad]
    infos = registered(ctx, mine)
    return [
        FreeWorker(
            w,
            host_of.get(w, "?"),
            infos[w].get("address", "127.0.0.1"),
            int(infos[w].get("devices", 1)),
        )
        for w in mine
    ]


def wait_for_capacity(job: Job, record: RecoveryRecord, blame: Blame) -> WaitForCapacity:
    """No spare, dp at min_dp and no re-plan fits: stop this generation and wait for
    workers; the scheduler places the job again (at its current layout) once they fit."""
    ft = job.spec.fault_tolerance
    lost = len({f.coord["dp"] for f in record.faults})
    msg = (
        f"{record.faults[0].detail}; no spare, and dropping the {lost} DP replica(s) "
        f"that lost ranks would leave dp={job.dp - lost} < min_dp={ft.min_dp} (or not "
        f"divide the global batch), and no other layout fits the healthy workers: waiting "
        f"for {job.ranks} workers"
    )
    record.action, record.to_shape = "wait", [job.dp, job.pp, job.tp]
    return WaitForCapacity(record, msg, blame)


def straggler(ctx: Pass, view: JobView, slow: FaultRecord, action: str) -> Decision | None:
    job, asg = view.job, view.asg
    if action == "replace" and has_candidate(ctx, job, asg, slow.worker):
        return recover(ctx, view, [slow])
    flag = StragglerFlag(rank=slow.rank, worker=slow.worker, generation=job.generation)
    if job.straggler == flag:  # reported once per rank and generation
        return None
    msg = f"rank {slow.rank} on {slow.worker} is a straggler: {slow.detail}" + (
        "" if action == "report" else "; no spare to replace it with"
    )
    return FlagStraggler(flag, msg)


def grow_back(ctx: Pass, view: JobView) -> Decision | None:
    """Back to the submitted layout once the workers for it are idle, at the next checkpoint
    commit: only the steps trained since that commit are redone. A shrunk job gains a DP
    replica at a time; a re-planned one (another pp or tp) returns to the spec's layout whole,
    the checkpoint resharded to it."""
    job, asg = view.job, view.asg
    p, t = job.spec.parallel, job.spec.train
    replanned = (asg.shape.pp, asg.shape.tp) != (p.pp, p.tp)
    if job.open_recovery or not (replanned or job.dp < job.target_dp):
        return None
    host_of = hosts(ctx, asg.workers)
    # The job's own spares first: a shrink keeps the dropped replica's healthy members as
    # spares, so with TP or PP the returning worker alone never makes a whole replica.
    free = alive_spares(ctx, job, asg, set(), host_of) + ctx.pool.workers
    if replanned:
        host_of |= {w.wid: w.host for w in free}
        layout = replan.submitted(job.spec, own_workers(ctx, asg, set(), host_of) + free, host_of)
    else:
        layout = grow(
            asg.shape,
            asg.ranks,
            job.target_dp,
            t.global_batch,
            p.microbatches,
            p.pp_schedule == "interleaved_1f1b",
            free,
            host_of,
        )
    if layout is None:
        return SetGrowAfter(None) if "grow_after" in job.current else None
    ckpt = int(ctx.store.checkpoint(job.id).get("step") or 0)
    if "grow_after" not in job.current:  # capacity seen: grow after the next commit
        return SetGrowAfter(ckpt)
    if ckpt <= job.current["grow_after"]:
        return None
    record = new_record(job, view.ranks, "CapacityReturned", [], ctx.now)
    used = {r.wid for r in layout.ranks}
    layout = Layout(
        layout.shape,
        layout.ranks,
        layout.microbatches,
        {},
        [w for w in asg.spares if w not in used],
    )
    record.action = "grow"
    record.to_shape = [layout.shape.dp, layout.shape.pp, layout.shape.tp]
    to = layout.shape
    change = (
        f"back to the submitted layout dp={to.dp} pp={to.pp} tp={to.tp} from dp={asg.shape.dp} "
        f"pp={asg.shape.pp} tp={asg.shape.tp}"
        if replanned
        else f"growing dp {asg.shape.dp} -> {to.dp}"
    )
    msg = (
        f"{len(free)} idle workers and spares: {change} after checkpoint {ckpt} (planned: not "
        "counted as a restart)"
    )
    return Grow(layout, record, msg, "RestoringLayout" if replanned else "GrowingDP")


# -- what the decisions read ----------------------------------------------------------
def alive_spares(
    ctx: Pass, job: Job, asg: Assignment, bad: set[str], host_of: dict[str, str]
) -> list[FreeWorker]:
    """The job's own spares that heartbeat, in assignment order."""
    alive = ctx.store.alive_among(
        [w for w in asg.spares if w not in bad], job.spec.fault_tolerance.dead_after_s
    )
    infos = ctx.store.workers(sorted(alive))
    return [
        FreeWorker(
            w,
            host_of.get(w, "?"),
            infos[w].get("address", "127.0.0.1"),
            int(infos[w].get("devices", 1)),
        )
        for w in asg.spares
        if w in alive
    ]


def has_candidate(ctx: Pass, job: Job, asg: Assignment, worker: str) -> bool:
    spares = ctx.store.alive_among(asg.spares, job.spec.fault_tolerance.dead_after_s)
    return bool(spares - {worker}) or bool(ctx.pool.workers)


def hosts(ctx: Pass, wids: list[str]) -> dict[str, str]:
    infos = registered(ctx, wids)
    return {w: registered_host(infos[w]) for w in wids}


def registered(ctx: Pass, wids: list[str]) -> dict[str, dict[str, str]]:
    """Each worker's registration (host, address, labels: fixed at its join), kept across
    passes by `Store.registrations`, so a 1,024-rank recovery reads only what joined anew; a
    worker with no join record is read as its hash stands."""
    got = ctx.store.registrations(wids)
    missing = [w for w in wids if w not in got]
    return {**got, **ctx.store.workers(missing)} if missing else got


def registered_host(info: dict[str, str]) -> str:
    """The host a worker's registration names: its `host` label (set at join; an agent's
    `--label host=...` overrides the host it reported), else its `host` field."""
    return loads(info.get("labels"), {}).get("host") or info.get("host", "?")


def collateral(
    ctx: Pass, job: Job, faults: list[FaultRecord]
) -> tuple[list[FaultRecord], dict[str, list[float]]]:
    """Blameless failures (every fault TrainerFailed) strike the worker whose rank exited
    first: the one whose error took the others down. `collateral_limit` strikes within
    `collateral_window_s` and the worker is blamed (RepeatedFailures) and replaced.
    Returns the faults (one re-blamed) and the strikes to store."""
    if not faults or any(f.cause != "TrainerFailed" for f in faults):
        return faults, {}
    ft = job.spec.fault_tolerance
    limit, window = ft.collateral_limit, ft.collateral_window_s
    first = min(faults, key=lambda f: f.fault_at)
    strikes = quarantine.strikes(ctx.store, first.worker, window, ctx.now)
    if len(strikes) < limit:
        return faults, {first.worker: strikes}
    blamed = first.model_copy(
        update={
            "cause": "RepeatedFailures",
            "detail": f"{first.detail}; its rank exited first in {len(strikes)} failures of the "
            f"whole world within {window:.0f}s (collateral_limit {limit}): the others "
            f"fell with it",
        }
    )
    return [blamed if f is first else f for f in faults], {first.worker: strikes}


# -- the record -----------------------------------------------------------------------
def new_record(
    job: Job, ranks: list[RankStatus], cause: str, faults: list[FaultRecord], now: float
) -> RecoveryRecord:
    return RecoveryRecord(
        # after the newest kept: the list is trimmed, and the ledger counts records by number
        n=(job.recoveries[-1].n if job.recoveries else 0) + 1,
        cause=cause,
        faults=faults,
        fault_at=min((f.fault_at for f in faults), default=now),
        detected_at=now,
        from_generation=job.generation,
        last_step=furthest_step(job, ranks),
    )


def furthest_step(job: Job, ranks: list[RankStatus]) -> int:
    """The furthest step any rank had completed when the fault was seen. A rank whose worker
    is gone may have no report left (it reads as step 0), so the job's own step, the slowest
    rank's from earlier reports and never going back, is a floor: with every report gone it
    is the step the world reached, not 0."""
    return max([job.step, *(r.step for r in ranks)])


def complete(job: Job, ranks: list[RankStatus], now: float) -> Complete | None:
    """The open record, completed, once every rank of its generation trained a step."""
    rec = job.open_recovery
    if rec is None or rec.to_generation != job.generation or rec.decided_at is None:
        return None
    if not ranks or any(r.first_step_at is None for r in ranks):
        return None
    rdzv = _slowest(r.rendezvous_at for r in ranks)
    ready = _slowest(r.ready_at for r in ranks)
    first = max(r.first_step_at for r in ranks)
    # the step every rank resumed from, as the trainers said (their `ready`); a rank that did
    # not say is left out rather than read as step 0, which would count the whole run as redone
    starts = [r.start_step for r in ranks if r.start_step is not None]
    start = min(starts) if starts else None
    spans = {
        "detect_s": (rec.fault_at, rec.detected_at),
        "decide_s": (rec.detected_at, rec.decided_at),
        "rendezvous_s": (rec.decided_at, rdzv),
        "restore_s": (rdzv, ready),
        "first_step_s": (ready, first),
        "total_s": (rec.fault_at, first),
    }
    # a mark some rank did not report (None, or 0: the epoch) leaves out the phases it bounds,
    # rather than timing them from the epoch
    d = {k: b - a for k, (a, b) in spans.items() if a and b}
    sources = {str(r.rank): r.restored_from for r in ranks if r.restored_from}
    done = rec.model_copy(
        update={
            "completed_at": now,
            "resumed_step": start,
            "steps_lost": None if start is None else max(0, rec.last_step - start),
            "durations": d,
            "restored_from": sources or None,
        }
    )
    msg = (
        f"recovery {rec.n} ({rec.cause}, {rec.action}) done"
        + (f" in {d['total_s']:.1f}s" if "total_s" in d else "")
        + ": "
        + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in d.items() if k != "total_s")
        + f"; {done.redone_summary()}"
        + (f"; restored from {done.restored_summary()}" if sources else "")
    )
    return Complete(done, msg)


def _slowest(marks: Iterable[float | None]) -> float | None:
    """The last of the ranks' marks, or None if any rank did not report its own (None or 0)."""
    got = list(marks)
    return max(got) if all(got) else None


def _message(first: FaultRecord, action: str, layout: Layout) -> str:
    c = first.coord
    what = (
        f"rank {first.rank} (dp={c['dp']} pp={c['pp']} tp={c['tp']}) on {first.worker}: "
        f"{first.detail}"
    )
    if action == "replace":
        moves = ", ".join(f"{o} -> {n}" for o, n in layout.moved.items())
        return f"{what}; spare promoted into the same coordinates ({moves})"
    if action == "shrink":
        return f"{what}; no spare: dp shrinks to {layout.shape.dp}, global batch kept"
    if action == "replan":
        s = layout.shape
        return (
            f"{what}; no spare and dp cannot drop: re-planned to dp={s.dp} pp={s.pp} "
            f"tp={s.tp} (microbatches {layout.microbatches}) on the healthy workers, global "
            "batch kept"
        )
    if first.cause == "TrainerKilled":
        return f"{what}; its agent lives: restarting the same mesh in place"
    return f"{what}; restarting the same mesh"
