"""The reconcile pass the lease holder runs: cancel, place, and follow running jobs.

Every write is one fenced transaction (`Store.commit`), so a controller that lost the lease
mid-pass changes nothing. The pass is stateless: all it knows it reads from Redis.

Faults of running jobs (dead, hung, straggling ranks) are handled by controller/faults.py.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable, Iterable

from controller.admission import PoolWorker, Quotas, capacity_problems, live_pool
from controller.availability import RedisAvailability
from controller.faults import FaultHandler
from controller.jobs import Job
from controller.placement import FreeWorker, Placement, natural_key, place
from controller.recovery import Layout
from controller.ranks import rank_view, summarize
from services.assignment import FINAL_RANK_STATES, Assignment
from services.mesh import MeshShape
from services.spec import SpecError, parse_spec
from services.store import Store, Tx, loads

log = logging.getLogger("meshkeeper.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    worker_alive_s: float = 3.0  # a worker silent longer than this is not placed on
    rdzv_ports: tuple[int, int] = (20000, 32000)  # below Linux's ephemeral range
    # Backfill bound (docs/control-plane.md, "Scheduling"): a job that fits the pool but has
    # waited this long gets first claim on freed workers; later jobs stop backfilling past it.
    reserve_after_s: float = 300.0
    quotas: Quotas = Quotas()


class FreePool:
    """The idle workers of one reconcile pass, read from Redis once (at first need). Whatever
    hands workers to a job in the pass (a pending job's start, a recovery, a grow-back) picks
    from `workers` and `take`s what it used, so no worker goes to two jobs in one pass.
    Workers released during the pass are not added: they are offered in the next one."""

    def __init__(self, read: Callable[[], list[FreeWorker]]):
        self._read = read
        self._workers: list[FreeWorker] | None = None

    @property
    def workers(self) -> list[FreeWorker]:
        if self._workers is None:
            self._workers = self._read()
        return list(self._workers)

    def take(self, wids: Iterable[str]) -> None:
        """Remove `wids` (those that are in the pool) for the rest of this pass."""
        gone = set(wids)
        self._workers = [w for w in self.workers if w.wid not in gone]


class Scheduler:
    def __init__(self, store: Store, cfg: SchedulerConfig, controller_id: str, *,
                 availability: RedisAvailability | None = None):
        self.store, self.cfg, self.me = store, cfg, controller_id
        self.availability = availability or RedisAvailability()  # see `follow`
        self.k = store.keys
        self.faults = FaultHandler(self)
        self.pool = FreePool(list)  # each pass starts its own (`run_once`)
        self._live: list[PoolWorker] | None = None  # every live worker, busy too (per pass)

    def run_once(self, lease: str) -> None:
        """Jobs in submission order. A waiting job (pending, or a recovery waiting for capacity)
        starts if its owner's quota and the idle workers allow; one that cannot does not block
        later ones (backfill) unless it fits the pool and has waited `reserve_after_s`: then it
        reserves, and later waiting jobs start only after it (docs/control-plane.md)."""
        jids = self.store.job_ids(open_only=True)
        if not jids:
            return
        now = self.store.now()
        # One pool per pass, not a fresh read per consumer: a list kept for pending jobs while
        # a recovery re-read Redis gave the worker that recovery took to a later pending job.
        self.pool = FreePool(lambda: self.free_workers(now))
        self._live = None
        records = self.store.jobs(jids)
        jobs = {jid: Job.from_hash(jid, records[jid]) for jid in jids}
        running = self.running_ranks([j for j in jobs.values() if j is not None])
        reserved_by: str | None = None
        for jid, job in jobs.items():
            if job is None:  # a half-written or deleted record: drop it from the queue
                self.store.commit(Tx().zrem(self.k.jobs_open(), jid), lease)
            elif job.cancel_requested:
                self.cancel(job, lease, now)
            elif job.phase == "Pending" or self.awaiting_capacity(job):
                if self.over_quota(job, running, lease, now):
                    continue
                if reserved_by is None and self.try_start(job, lease, now):
                    running[job.owner] = running.get(job.owner, 0) + self.ranks(job)
                    continue
                if reserved_by is None and self.reserves(job, now):
                    reserved_by = jid
                self.wait(job, reserved_by, lease, now)
            elif job.phase in ("Running", "Recovering"):
                self.follow(job, lease, now)

    @staticmethod
    def awaiting_capacity(job: Job) -> bool:
        rec = job.open_recovery
        return bool(rec) and rec.get("action") == "wait" and rec.get("to_generation") is None

    # -- placing --------------------------------------------------------------------------
    def free_workers(self, now: float) -> list[FreeWorker]:
        """Alive workers whose agent is idle and that no job holds, in name order; only
        workers the controller registered at join (`joined_at`): a name that is only in
        `workers:seen` (any agent may beat there) never gets a rank."""
        wids = self.faults.admissible(sorted(self.store.alive_workers(self.cfg.worker_alive_s, now), key=natural_key), now)  # quarantine
        infos, pointers = self.store.workers(wids), self.store.assignments(wids)
        return [FreeWorker(w, loads(infos[w].get("labels"), {}).get("host") or infos[w].get("host", "?"),
                           infos[w].get("address", "127.0.0.1"), int(infos[w].get("devices", 1)))
                for w in wids if infos[w].get("joined_at") and infos[w].get("state") == "idle" and not pointers[w]]

    def try_start(self, job: Job, lease: str, now: float) -> Placement | None:
        """Start `job` on workers of the pass's pool (and take them), if they fit."""
        p = job.spec["parallel"]
        shape = MeshShape(job.dp, p["pp"], p["tp"])  # smaller than the spec's after a shrink
        placed = place(shape, job.spec["fault_tolerance"]["spares"], self.pool.workers)
        if placed is None:
            return None
        job.started_at = job.started_at or now
        layout = Layout(shape, placed.ranks, job.microbatches or p["microbatches"], {}, placed.spares)
        rec = job.open_recovery  # a recovery that waited for capacity ends here
        if rec:
            rec.update(to_generation=job.generation + 1, decided_at=now)
        asg = self.start_generation(job, layout, None, "Starting", lease, now, tp_split=placed.tp_split)
        self.pool.take(placed.workers)
        where = f"{len(set(r.wid for r in asg.ranks))} workers" + (
            f" + {len(asg.spares)} spares" if asg.spares else "")
        log.info("job %s: generation %d on %s", job.id, asg.generation, where)
        return placed

    def start_generation(self, job: Job, layout: Layout, old: Assignment | None, reason: str,
                         lease: str, now: float, *, tp_split: bool = False,
                         event: tuple[str, str, str] | None = None) -> Assignment:
        """Write generation+1 in one fenced transaction: the assignment, every worker's pointer,
        and the release of workers of `old` that the new generation no longer uses. Agents of a
        superseded generation stop their trainers; a fresh rendezvous port fences them out."""
        wids = list(dict.fromkeys([r.wid for r in layout.ranks] + layout.spares))
        infos = self.store.workers(wids)
        master = infos[layout.ranks[0].wid].get("address", "127.0.0.1")
        gen = job.generation + 1
        asg = Assignment(job.id, gen, layout.shape, master, self.pick_port(master), layout.ranks,
                         layout.spares, tp_split,
                         None if layout.shape.dp == job.target_dp else layout.microbatches)
        job.generation = gen
        job.current = {} if layout.shape.dp == job.target_dp else {
            "dp": layout.shape.dp, "microbatches": layout.microbatches}
        where = f"{len(set(r.wid for r in asg.ranks))} workers" + (
            f" + {len(asg.spares)} spares" if asg.spares else "")
        job.set("Running", True, reason, f"generation {gen} placed on {where}; rendezvous "
                f"{asg.master_addr}:{asg.master_port}", now)
        tx = Tx().hset(self.k.job(job.id), job.fields())
        tx.delete(self.k.job_assignment(job.id)).hset(self.k.job_assignment(job.id), asg.to_fields())
        for wid in asg.workers:
            role = "rank" if asg.ranks_of(wid) else "spare"
            tx.delete(self.k.worker_assignment(wid))
            tx.hset(self.k.worker_assignment(wid), {"job": job.id, "generation": gen, "role": role})
            tx.publish(self.k.worker_assignment(wid), job.id)
        for wid in (old.workers if old else []):
            if wid not in asg.workers:
                tx.delete_if(self.k.worker_assignment(wid), "job", job.id)
                tx.publish(self.k.worker_assignment(wid), job.id)
        kind, why, msg = event or ("Normal", "Placed", f"generation {gen} on {where}" + (
            " (a TP group spans hosts: no host had room for it)" if tp_split else ""))
        tx.event(self.k.job_events(job.id), self._event(kind, why, msg, now, gen))
        self.store.commit(tx, lease)
        return asg

    def pick_port(self, master: str) -> int:
        """A fresh rendezvous port, not one an open job on the same host uses."""
        used = set()
        for jid in self.store.job_ids(open_only=True):
            a = self.store.job_assignment(jid)
            if a.get("master_addr") == master:
                used.add(int(a.get("master_port", 0)))
        lo, hi = self.cfg.rdzv_ports
        while True:
            port = random.randrange(lo, hi)
            if port not in used:
                return port

    # -- waiting: backfill order and quotas ------------------------------------------------
    @staticmethod
    def ranks(job: Job) -> int:
        p = job.spec["parallel"]
        return job.dp * p["pp"] * p["tp"]

    def running_ranks(self, jobs: list[Job]) -> dict[str | None, int]:
        """owner -> ranks of its jobs that hold workers now (what quotas count)."""
        out: dict[str | None, int] = {}
        for job in jobs:
            if job.phase in ("Running", "Recovering") and not self.awaiting_capacity(job):
                out[job.owner] = out.get(job.owner, 0) + self.ranks(job)
        return out

    def over_quota(self, job: Job, running: dict[str | None, int], lease: str, now: float) -> bool:
        """True (and the job marked WaitingForQuota) when starting it would put its owner over
        the quota; it waits without blocking anyone (a job larger than the whole quota was
        refused at submission)."""
        limit = self.cfg.quotas.limit(job.owner)
        used = running.get(job.owner, 0)
        if limit is None or used + self.ranks(job) <= limit:
            return False
        self._waiting(job, "WaitingForQuota", f"needs {self.ranks(job)} ranks; owner "
                      f"{job.owner or 'anonymous'} runs {used} of its quota of {limit}", lease, now)
        return True

    def live(self) -> list[PoolWorker]:
        if self._live is None:
            self._live = live_pool(self.store, self.cfg.worker_alive_s)
        return self._live

    def fits_pool(self, job: Job) -> bool:
        """Whether the job would fit the live pool were every worker idle (admission's test)."""
        try:
            spec = parse_spec(job.spec)
        except SpecError:  # stored before a stricter check: the pass must go on
            return False
        return bool(self.live()) and not capacity_problems(spec, self.live())

    def reserves(self, job: Job, now: float) -> bool:
        """The starvation bound: a job that could run were workers freed, waiting for
        `reserve_after_s` since it last stopped running (or was submitted)."""
        since = (job.condition("Running") or {}).get("lastTransitionTime") or job.submitted_at or now
        return now - since >= self.cfg.reserve_after_s and self.fits_pool(job)

    def wait(self, job: Job, reserved_by: str | None, lease: str, now: float) -> None:
        spares = job.spec["fault_tolerance"]["spares"]
        free = self.pool.workers
        if reserved_by is not None and reserved_by != job.id:
            msg = (f"queued behind job {reserved_by}, which has waited over "
                   f"{self.cfg.reserve_after_s:g}s and has first claim on freed workers")
        else:
            msg = (f"needs {self.ranks(job)} worker slots + {spares} spare workers; "
                   f"{sum(w.slots for w in free)} slots on {len(free)} idle workers")
            if reserved_by == job.id:
                msg += "; later jobs wait behind it (it has waited the longest)"
            elif not self.fits_pool(job):
                msg += "; more than the live pool holds even when idle: waiting for workers to join"
        self._waiting(job, "WaitingForCapacity", msg, lease, now)

    def _waiting(self, job: Job, reason: str, msg: str, lease: str, now: float) -> None:
        was = (job.condition("Running") or {}).get("reason")
        if job.set("Running", False, reason, msg, now):
            tx = Tx().hset(self.k.job(job.id), job.fields())
            if was != reason:  # an event when it starts waiting, not per count change
                tx.event(self.k.job_events(job.id), self._event("Normal", reason, msg, now, job.generation))
            self.store.commit(tx, lease)

    # -- running jobs ------------------------------------------------------------------
    def follow(self, job: Job, lease: str, now: float) -> None:
        asg = Assignment.from_fields(self.store.job_assignment(job.id))
        if asg is None or asg.generation != job.generation:
            return  # being rewritten; next pass
        seen = self.store.last_seen(asg.workers)
        progress = self.store.progress(asg.workers)
        dead_after = job.spec["fault_tolerance"]["dead_after_s"]
        # Silence (heartbeat age, frozen progress) counts only if Redis could take the agents'
        # reports all along: after a stall or restart of Redis, or a gap in our own access to
        # it, nothing is judged until it has been available for a full dead_after_s again
        # (controller/availability.py). The probe comes after the reads above, so a stall
        # between `now` and them is seen too.
        self.availability.probe(self.store)
        judge = seen if self.availability.steady(dead_after) else None
        alive = {w for w, t in seen.items() if now - t <= dead_after} if judge is not None else None
        ranks = rank_view(asg, progress, alive)
        if all(r["state"] == "succeeded" for r in ranks):
            self.finish(job, asg, ranks, "Succeeded", "AllRanksSucceeded",
                        f"{len(ranks)} ranks finished {job.total_steps} steps", lease, now)
            return
        if self.faults.check(job, asg, ranks, judge, lease, now):
            return
        before = job.fields()
        job.absorb(summarize(ranks))
        if job.step > 0 and not job.open_recovery and all(r["state"] == "running" for r in ranks):
            job.set("Running", True, "Training", f"generation {job.generation}: all "
                    f"{len(ranks)} ranks training", now)
        if job.fields() != before:
            self.store.commit(Tx().hset(self.k.job(job.id), job.fields()), lease)

    # -- endings -----------------------------------------------------------------------
    def cancel(self, job: Job, lease: str, now: float) -> None:
        asg = Assignment.from_fields(self.store.job_assignment(job.id)) if job.generation else None
        ranks = rank_view(asg, self.store.progress(asg.workers)) if asg else []
        self.finish(job, asg, ranks, "Failed", "Cancelled", "cancelled on request", lease, now)

    def finish(self, job: Job, asg: Assignment | None, ranks: list[dict], outcome: str,
               reason: str, message: str, lease: str, now: float) -> None:
        """Terminal state, the final rank view kept on the job, and every worker released."""
        job.absorb(summarize(ranks))
        # ranks still going are being stopped by this very transaction
        job.final_ranks = [{**r, "state": r["state"] if r["state"] in FINAL_RANK_STATES else "stopped"}
                           for r in ranks]
        job.finished_at = now
        job.set("Running", False, reason, message, now)
        job.set(outcome, True, reason, message, now)
        tx = Tx().hset(self.k.job(job.id), job.fields()).zrem(self.k.jobs_open(), job.id)
        for wid in asg.workers if asg else []:
            tx.delete_if(self.k.worker_assignment(wid), "job", job.id)
            tx.publish(self.k.worker_assignment(wid), job.id)
        kind = "Normal" if outcome == "Succeeded" else "Warning"
        tx.event(self.k.job_events(job.id), self._event(kind, reason, message, now, job.generation))
        self.store.commit(tx, lease)
        log.info("job %s: %s (%s) %s", job.id, outcome, reason, message)

    def _event(self, kind: str, reason: str, message: str, now: float, generation: int) -> dict:
        return {"time": now, "type": kind, "reason": reason, "message": message,
                "generation": generation, "source": f"controller/{self.me}"}
