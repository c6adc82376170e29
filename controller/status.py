"""The REST documents about jobs and workers (services/api.py), read from Redis only
(docs/architecture.md, "Records")."""

from __future__ import annotations

import statistics

from controller import goodput, history
from controller.conditions import TERMINAL
from controller.jobs import Job
from controller.placement import natural_key
from controller.ranks import rank_view, summarize
from services import api, assignment
from services.records import perplexity
from services.store import Store, loads


def job_summary(job: Job) -> api.JobSummary:
    p = job.spec.parallel
    ep = p.ep if p.ep > 1 else None
    running = api.Coordinate(dp=job.dp, pp=job.pp, tp=job.tp, ep=ep)
    target = api.Coordinate(dp=p.dp, pp=p.pp, tp=p.tp, ep=ep)
    return api.JobSummary(
        id=job.id,
        name=job.name,
        phase=job.phase,
        generation=job.generation,
        restarts=job.restarts,
        step=job.step,
        steps=job.total_steps,
        loss=job.loss,
        mesh_shape=running,
        target_shape=target if target != running else None,
        submitted_at=job.submitted_at,
        finished_at=job.finished_at,
        owner=job.owner,
    )


def job_status(store: Store, job: Job, alive_within_s: float) -> api.JobStatus:
    """Summary + conditions, live progress, the last checkpoint and every rank of the mesh."""
    asg = assignment.current(store, job.id, job.generation) if job.generation else None
    ranks: list[api.RankStatus] = []
    if job.phase in (*TERMINAL, "Suspended"):
        ranks = job.final_ranks  # as the controller saw them at the end (or the suspend)
    elif asg is not None:
        alive = store.alive_among(asg.workers, alive_within_s)
        ranks = rank_view(asg, store.progress(asg.workers), alive)
        flag = job.straggler  # a straggler reported (not replaced) in this generation
        if flag and flag.generation == asg.generation and flag.rank < len(ranks):
            r = ranks[flag.rank]  # rank_view lists every rank in rank order
            if r.state == "running":
                ranks[flag.rank] = r.model_copy(update={"state": "straggler"})
        job.absorb(summarize(ranks))  # fresher than the controller's last write
    ckpt = store.checkpoint(job.id)
    shape = (
        api.Coordinate(
            dp=asg.shape.dp,
            pp=asg.shape.pp,
            tp=asg.shape.tp,
            ep=asg.shape.ep if asg.shape.ep > 1 else None,
        )
        if asg
        else job_summary(job).mesh_shape
    )
    return api.JobStatus(
        **job_summary(job).model_dump(),
        conditions=job.conditions,
        tokens_per_s=job.tokens_per_s,
        step_s=job.step_s,
        epoch=job.epoch,
        eval_loss=job.eval_loss,
        eval_perplexity=perplexity(job.eval_loss) if job.eval_loss is not None else None,
        eval_step=job.eval_step,
        eta_s=_eta(store, job),
        started_at=job.started_at,
        last_checkpoint=(
            api.Checkpoint(
                step=int(ckpt["step"]),
                path=ckpt.get("path"),
                time=float(ckpt["time"]),
                generation=int(ckpt["generation"]),
            )
            if ckpt.get("step")
            else None
        ),
        export=next((r.export for r in ranks if r.export), None),
        suspend_requested=job.suspend_requested,
        recoveries=job.recoveries,
        # a flag from an earlier generation is history: that world is gone
        straggler=job.straggler
        if job.straggler and job.straggler.generation == job.generation
        else None,
        goodput=goodput.view(job, store.now()),
        mesh=api.Mesh(
            shape=shape,
            generation=asg.generation if asg else None,
            rendezvous=f"{asg.master_addr}:{asg.master_port}" if asg else None,
            ranks=ranks,
            spares=asg.spares if asg else [],
            dp_labels=asg.labels if asg else [],
        ),
        spec=job.spec.model_dump(mode="json"),
    )


ETA_WINDOW = 21  # history points (about one a step) whose step time the ETA takes


def _eta(store: Store, job: Job) -> float | None:
    if job.phase != "Running" or not job.step_s:
        return None
    times = [p.step_s for p in history.recent(store, job.id, ETA_WINDOW) if p.step_s]
    return eta(job.total_steps - job.step, times or [job.step_s])


def eta(remaining: int, step_times: list[float]) -> float:
    """Seconds for the `remaining` steps at the median of the recent steps' times. The latest
    step's time alone swung the ETA 4:13 -> 10:26 -> 4:45 within seconds: one slow step (an
    eval, a checkpoint save, a busy neighbour) moves the median by at most one place, while a
    slowdown that lasts past half the window (a shrunk mesh) moves it all the way."""
    return max(0, remaining) * statistics.median(step_times)


def workers_status(store: Store, alive_within_s: float) -> list[dict]:
    """Every worker ever seen: identity, liveness (by server time) and what it serves."""
    now = store.now()
    seen = store.workers_seen()
    wids = sorted(seen, key=natural_key)
    infos, pointers = store.workers(wids), store.assignments(wids)
    # a pointer names the job and role; the generation is the job's (a few jobs, read once)
    generations = store.generations({p["job"] for p in pointers.values() if p.get("job")})
    out = []
    for w in wids:
        info, ptr = infos[w], pointers[w]
        alive = seen[w] >= now - alive_within_s
        out.append(
            {
                "id": w,
                "host": info.get("host"),
                "address": info.get("address"),
                "labels": loads(info.get("labels"), {}),
                "devices": int(info.get("devices", 1)),
                "state": info.get("state", "unknown") if alive else "dead",
                "alive": alive,
                "last_seen_s": round(now - seen[w], 3),
                "job": ptr.get("job"),
                "generation": generations.get(ptr.get("job")),
                "role": ptr.get("role"),
            }
        )
    return out
