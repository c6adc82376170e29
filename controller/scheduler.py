"""The reconcile pass the lease holder runs: cancel, place, and follow running jobs.

Every write is one fenced transaction (controller/apply.py), so a controller that lost the
lease mid-pass changes nothing. The pass is stateless: all it knows it reads from Redis, into
one `Pass` (controller/passes.py) handed to everything it calls. Placing is
controller/placing.py, waiting controller/waiting.py, running jobs controller/following.py
(their faults: controller/faults.py).
"""

from __future__ import annotations

import logging

import redis

from controller import apply, goodput, placing, preempting, suspending, waiting
from controller.availability import RedisAvailability
from controller.following import follow
from controller.jobs import Job
from controller.passes import (
    FreePool,
    JobView,
    Pass,
    PoolUnreadable,
    SchedulerConfig,
    WorkerActions,
)
from controller.placement import FreeWorker
from controller.ranks import rank_view
from services import assignment
from services.store import Fenced, Store

log = logging.getLogger("meshkeeper.scheduler")


class Scheduler:
    def __init__(
        self,
        store: Store,
        cfg: SchedulerConfig,
        controller_id: str,
        *,
        availability: RedisAvailability | None = None,
        actions: WorkerActions | None = None,
    ):
        self.store, self.cfg, self.me, self.actions = store, cfg, controller_id, actions
        self.availability = availability or RedisAvailability()  # see controller/following.py
        self._stuck: dict[str, float] = {}  # job -> when its handling started failing

    def free_workers(self, now: float, held: frozenset[str] = frozenset()) -> list[FreeWorker]:
        """The workers a pass would hand out (idle, joined, not quarantined, not `held`)."""
        return placing.free_workers(self.store, self.cfg.worker_alive_s, now, held)

    def run_once(self, lease: str) -> None:
        """Jobs by priority value, then in submission order. A waiting job (pending, or a
        recovery waiting for capacity) starts if its owner's quota and the idle workers allow;
        one that cannot does not block later ones (backfill) unless it fits the pool and has
        waited `reserve_after_s`, or it preempts lower jobs to run: then it reserves, and
        later waiting jobs start only after it (docs/control-plane.md)."""
        jids = self.store.job_ids(open_only=True)
        if not jids:
            return
        now = self.store.now()
        records = self.store.jobs(jids)
        jobs = {jid: Job.from_hash(jid, records[jid]) for jid in jids}
        readable = [j for j in jobs.values() if j is not None]
        self._stuck = {jid: t for jid, t in self._stuck.items() if jid in jobs}
        # One pool per pass, not a fresh read per consumer: a list kept for pending jobs while
        # a recovery re-read Redis gave the worker that recovery took to a later pending job.
        ctx = Pass(
            self.store,
            self.cfg,
            self.me,
            lease,
            now,
            FreePool(lambda: self.free_workers(now, placing.held_workers(self.store, readable))),
            self.actions,
        )
        running = waiting.running_ranks(readable)
        reserved_by: str | None = None
        # higher priority values first; within a value, submission order (a stable sort)
        value = {j.id: self.cfg.priorities.of(j.spec).value for j in readable}
        for jid, job in sorted(jobs.items(), key=lambda kv: -value.get(kv[0], 0)):
            try:
                reserved_by = self._handle(ctx, jid, job, running, reserved_by, readable)
                self._stuck.pop(jid, None)
            except (Fenced, PoolUnreadable, redis.ConnectionError, redis.TimeoutError):
                raise  # the lease is gone, Redis is, or the pool: the whole pass stops
            except Exception as e:  # one job's bad state must not stop the others
                self._skipped(ctx, jid, job, e)

    def _skipped(self, ctx: Pass, jid: str, job: Job | None, error: Exception) -> None:
        """`jid`'s handling raised `error`: counted and logged once, skipped while it goes on
        failing, and failed with the error as its reason once it has for `fail_stuck_after_s`."""
        what = f"{type(error).__name__}: {error}"
        if jid not in self._stuck:
            self._stuck[jid] = ctx.now
            self.store.state_errors["job"] += 1
            log.warning(
                "job %s: skipped (%s); the other jobs go on, and it is failed if this lasts %g s",
                jid,
                what,
                self.cfg.fail_stuck_after_s,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
        bound = self.cfg.fail_stuck_after_s
        if job is None or ctx.now - self._stuck[jid] < bound:
            return
        why = (
            f"the controller could not handle this job's stored state for "
            f"{bound:g} s ({what}); it was failed and its workers released"
        )
        try:
            asg = assignment.current(ctx.store, jid, job.generation) if job.generation else None
            apply.finish(ctx, JobView(job, asg, []), "Failed", "ControllerError", why)
        except (Fenced, redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception:  # its record is beyond even failing it: it stays skipped
            log.exception("job %s: could not be failed either; it stays skipped", jid)
        else:
            del self._stuck[jid]

    def _handle(
        self,
        ctx: Pass,
        jid: str,
        job: Job | None,
        running: dict[str, int],
        reserved_by: str | None,
        jobs: list[Job],
    ) -> str | None:
        """One job's turn in the pass; returns the job that reserves the pool, if any."""
        if job is not None:  # its time until now, by the state it was in, before it changes
            goodput.account(job, ctx.now)
        if job is None:  # half-written, deleted, or unreadable: drop it from the queue
            log.warning("job %s: no readable record; removed from the queue", jid)
            apply.drop_unreadable(ctx, jid)
        elif job.cancel_requested:
            cancel(ctx, job)
        elif job.phase == "Suspended":
            if not job.suspend_requested:
                suspending.resume(ctx, job)
        elif job.suspend_requested and job.phase == "Pending":
            suspending.suspend_waiting(ctx, job)
        elif job.phase == "Pending" or job.awaiting_capacity:
            if waiting.over_quota(ctx, job, running):
                return reserved_by
            if reserved_by is None and placing.try_start(ctx, job):
                running[job.owner] = running.get(job.owner, 0) + job.ranks
                return reserved_by
            if reserved_by is None and preempting.try_preempt(ctx, job, jobs, self.cfg.priorities):
                return jid  # the workers its victims free are its own
            if reserved_by is None and waiting.reserves(ctx, job):
                reserved_by = jid
            waiting.wait(ctx, job, reserved_by)
        elif job.phase in ("Running", "Recovering"):
            follow(ctx, job, self.availability)
        return reserved_by


def cancel(ctx: Pass, job: Job) -> None:
    asg = assignment.current(ctx.store, job.id, job.generation) if job.generation else None
    ranks = rank_view(asg, ctx.store.progress(asg.workers)) if asg else []
    apply.finish(ctx, JobView(job, asg, ranks), "Cancelled", "Cancelled", "cancelled on request")
