"""Fault handling for running jobs: detect, decide, enact, and record each recovery.

The scheduler calls `FaultHandler.check` on every pass for every running job. A recovery
is one record on the job (`recoveries`): cause, faults, action, the workers moved, steps
lost, and the duration of each phase, filled in once every rank of the new generation
has trained its first step:
    detect      fault (exit, last heartbeat, last progress) -> noticed here
    decide      noticed -> the new generation written
    rendezvous  written -> the slowest rank's process group formed
    restore     -> the slowest rank restored the checkpoint
    first_step  -> the slowest rank finished its first step
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from controller import health
from controller.jobs import Job
from controller.placement import FreeWorker
from controller.recovery import Layout, grow, replace_workers, shrink
from services.assignment import Assignment
from services.store import Tx, loads

if TYPE_CHECKING:
    from controller.scheduler import Scheduler

log = logging.getLogger("meshkeeper.recovery")
KEEP_RECORDS = 50
# Causes that point at the worker itself: it is kept out of the free pool for the spec's
# fault_tolerance.quarantine_s, then re-admitted only once its agent's health probe passed
# (worker/probe.py). A trainer killed from outside (TrainerKilled) or a silent host
# (WorkerDead, restarted by its pool) says nothing about the worker's health.
QUARANTINED = ("RankHung", "Straggler", "RepeatedFailures")


class FaultHandler:
    def __init__(self, sched: "Scheduler"):
        self.s = sched

    # -- the pass -----------------------------------------------------------------------
    def check(self, job: Job, asg: Assignment, ranks: list[dict], seen: dict[str, float] | None,
              lease: str, now: float) -> bool:
        """Act on a fault or on returning capacity; True when this pass wrote the job. `seen`
        None: Redis just restarted, so silence (heartbeats, progress) proves nothing yet."""
        ft = job.spec["fault_tolerance"]
        oom = health.out_of_memory(ranks)
        if oom:  # before anything spends a spare: the spare would be killed the same way
            self.s.finish(job, asg, ranks, "Failed", "OutOfMemory", oom, lease, now)
            return True
        why = health.deterministic_failure(ranks)
        if why:
            self.s.finish(job, asg, ranks, "Failed", "TrainerFailed", why, lease, now)
            return True
        faults = (health.dead_or_killed(ranks, seen, ft["dead_after_s"], now)
                  or (health.hangs(ranks, ft["hang_after_s"], now) if seen is not None else [])
                  or health.collateral_only(ranks, now))
        if faults:
            self.recover(job, asg, ranks, faults, lease, now)
            return True
        st = ft["straggler"]
        slow = health.straggler(ranks, st["slowdown"], st["window_steps"], now)
        if slow and self.straggler(job, asg, ranks, slow, st["action"], lease, now):
            return True
        self.complete(job, ranks, lease, now)
        return self.maybe_grow(job, asg, ranks, lease, now)

    # -- recovery -----------------------------------------------------------------------
    def recover(self, job: Job, asg: Assignment, ranks: list[dict], faults: list[health.Fault],
                lease: str, now: float) -> None:
        ft = job.spec["fault_tolerance"]
        faults = self._collateral(job, faults, lease, now)
        first = min(faults, key=lambda f: f.fault_at)
        record = self._record(job, ranks, first.cause, faults, now)
        record["quarantined"] = self._quarantine(job, faults, lease, now)
        job.restarts += 1
        if job.restarts > ft["max_restarts"]:
            msg = (f"{first.detail} (rank {first.rank} on {first.worker}); {job.restarts - 1} "
                   f"restarts already, max_restarts is {ft['max_restarts']}")
            self.s.finish(job, asg, ranks, "Failed", "ReachedMaxRestarts", msg, lease, now)
            return
        bad = {f.worker for f in faults if f.cause not in health.BLAMELESS}
        layout, action = self.plan(job, asg, bad)
        if layout is None:
            self.wait_for_capacity(job, asg, ranks, record, lease, now)
            return
        # A worker whose trainer was killed but whose agent lives stays as a spare.
        alive_again = [f.worker for f in faults if f.cause == "TrainerKilled" and f.worker in layout.moved]
        layout = Layout(layout.shape, layout.ranks, layout.microbatches, layout.moved,
                        layout.spares + [w for w in alive_again if w not in layout.spares])
        record.update(action=action, replaced=[{"old": o, "new": n} for o, n in layout.moved.items()],
                      to_shape=[layout.shape.dp, layout.shape.pp, layout.shape.tp])
        msg = self._message(first, action, layout)
        self._enact(job, asg, layout, record, _reason(action), msg, "Warning", lease, now)

    def plan(self, job: Job, asg: Assignment, bad: set[str]) -> tuple[Layout | None, str]:
        """The next generation's layout. The idle workers it promotes are taken from the pass's
        pool here: the caller writes the layout it gets."""
        p, t = job.spec["parallel"], job.spec["train"]
        mb = asg.microbatches or p["microbatches"]
        host_of = self.hosts(asg.workers)
        spares = self.alive_spares(job, asg, bad, host_of)
        candidates = spares + [w for w in self.s.pool.workers if w.wid not in bad]
        keep = [w.wid for w in spares]
        layout = replace_workers(asg.shape, asg.ranks, mb, bad, candidates, keep, host_of)
        if layout is not None:
            self.s.pool.take(layout.moved.values())
            return layout, "restart" if not bad else "replace"
        layout = shrink(asg.shape, asg.ranks, bad, job.spec["fault_tolerance"]["min_dp"],
                        t["global_batch"], mb, p["pp_schedule"] == "interleaved_1f1b", host_of)
        if layout is not None:
            layout = Layout(layout.shape, layout.ranks, layout.microbatches, {}, keep + layout.spares)
            return layout, "shrink"
        return None, "wait"

    def wait_for_capacity(self, job: Job, asg: Assignment, ranks: list[dict], record: dict,
                          lease: str, now: float) -> None:
        """No spare and dp at min_dp: stop this generation and wait for workers; the
        scheduler places the job again (at its current dp) as soon as they fit."""
        p = job.spec["parallel"]
        lost = len({f["coord"]["dp"] for f in record["faults"]})
        msg = (f"{record['faults'][0]['detail']}; no spare, and dropping the {lost} DP replica(s) "
               f"that lost ranks would leave dp={job.dp - lost} < min_dp="
               f"{job.spec['fault_tolerance']['min_dp']} (or not divide the global batch): waiting "
               f"for {job.dp * p['pp'] * p['tp']} workers")
        record.update(action="wait", to_shape=[job.dp, p["pp"], p["tp"]])
        job.recoveries = (job.recoveries + [record])[-KEEP_RECORDS:]
        job.set("Recovering", True, "WaitingForCapacity", msg, now)
        job.set("Running", False, "WaitingForCapacity", msg, now)
        tx = Tx().hset(self.s.k.job(job.id), job.fields())
        for wid in asg.workers:
            tx.delete_if(self.s.k.worker_assignment(wid), "job", job.id)
            tx.publish(self.s.k.worker_assignment(wid), job.id)
        tx.event(self.s.k.job_events(job.id), self.s._event("Warning", "WaitingForCapacity", msg, now,
                                                             job.generation))
        self.s.store.commit(tx, lease)
        log.warning("job %s: %s", job.id, msg)

    def straggler(self, job: Job, asg: Assignment, ranks: list[dict], slow: health.Fault, action: str,
                  lease: str, now: float) -> bool:
        flag = {"rank": slow.rank, "worker": slow.worker, "generation": job.generation}
        if action == "replace" and self.has_candidate(job, asg, slow.worker):
            self.recover(job, asg, ranks, [slow], lease, now)
            return True
        if job.flagged != flag:  # report once per rank and generation
            job.flagged = flag
            msg = f"rank {slow.rank} on {slow.worker} is a straggler: {slow.detail}" + (
                "" if action == "report" else "; no spare to replace it with")
            tx = Tx().hset(self.s.k.job(job.id), job.fields())
            tx.event(self.s.k.job_events(job.id), self.s._event("Warning", "StragglerDetected", msg, now,
                                                                 job.generation))
            self.s.store.commit(tx, lease)
            return True
        return False

    def alive_spares(self, job: Job, asg: Assignment, bad: set[str],
                     host_of: dict[str, str]) -> list[FreeWorker]:
        """The job's own spares that heartbeat, in assignment order."""
        alive = self.s.store.alive_among([w for w in asg.spares if w not in bad],
                                         job.spec["fault_tolerance"]["dead_after_s"])
        infos = self.s.store.workers(sorted(alive))
        return [FreeWorker(w, host_of.get(w, "?"), infos[w].get("address", "127.0.0.1"),
                           int(infos[w].get("devices", 1))) for w in asg.spares if w in alive]

    def has_candidate(self, job: Job, asg: Assignment, worker: str) -> bool:
        spares = self.s.store.alive_among(asg.spares, job.spec["fault_tolerance"]["dead_after_s"])
        return bool(spares - {worker}) or bool(self.s.pool.workers)

    def maybe_grow(self, job: Job, asg: Assignment, ranks: list[dict], lease: str, now: float) -> bool:
        """Back to the target dp once a replica's worth of workers is idle, at the next
        checkpoint commit: only the steps trained since that commit are redone."""
        if job.dp >= job.target_dp or job.open_recovery:
            return False
        p, t = job.spec["parallel"], job.spec["train"]
        host_of = self.hosts(asg.workers)
        # The job's own spares first: a shrink keeps the dropped replica's healthy members as
        # spares, so with TP or PP the returning worker alone never makes a whole replica.
        free = self.alive_spares(job, asg, set(), host_of) + self.s.pool.workers
        layout = grow(asg.shape, asg.ranks, job.target_dp, t["global_batch"], p["microbatches"],
                      p["pp_schedule"] == "interleaved_1f1b", free, host_of)
        ckpt = int(self.s.store.checkpoint(job.id).get("step") or 0)
        if layout is None:
            job.current.pop("grow_after", None)
            return False
        if "grow_after" not in job.current:  # capacity seen: grow after the next commit
            job.current["grow_after"] = ckpt
            self.s.store.commit(Tx().hset(self.s.k.job(job.id), job.fields()), lease)
            return True
        if ckpt <= job.current["grow_after"]:
            return False
        record = self._record(job, ranks, "CapacityReturned", [], now)
        used = {r.wid for r in layout.ranks}
        self.s.pool.take(used)
        layout = Layout(layout.shape, layout.ranks, layout.microbatches, {},
                        [w for w in asg.spares if w not in used])
        record.update(action="grow", to_shape=[layout.shape.dp, layout.shape.pp, layout.shape.tp])
        msg = (f"{len(free)} idle workers and spares: growing dp {asg.shape.dp} -> {layout.shape.dp} after "
               f"checkpoint {ckpt} (planned: not counted as a restart)")
        self._enact(job, asg, layout, record, "GrowingDP", msg, "Normal", lease, now)
        return True

    def _enact(self, job: Job, asg: Assignment, layout: Layout, record: dict, reason: str, msg: str,
               kind: str, lease: str, now: float) -> None:
        """Record the recovery and write its generation, in one fenced transaction."""
        record.update(to_generation=job.generation + 1, decided_at=self.s.store.now())
        job.recoveries = (job.recoveries + [record])[-KEEP_RECORDS:]
        job.set("Recovering", True, reason, msg, now)
        event = "RecoveryStarted" if kind == "Warning" else reason
        self.s.start_generation(job, layout, asg, "Recovering", lease, now, event=(kind, event, msg))
        log.log(logging.WARNING if kind == "Warning" else logging.INFO, "job %s: %s", job.id, msg)

    # -- blame beyond one recovery: collateral strikes, quarantine ----------------------
    def _health_key(self, wid: str) -> str:
        return self.s.k.worker(wid) + ":health"  # controller-written; worker/probe.py reads it

    def _collateral(self, job: Job, faults: list[health.Fault], lease: str, now: float) -> list[health.Fault]:
        """Blameless failures (every fault TrainerFailed) strike the worker whose rank exited
        first: the one whose error took the others down. `collateral_limit` strikes within
        `collateral_window_s` and the worker is blamed (RepeatedFailures) and replaced."""
        if not faults or any(f.cause != "TrainerFailed" for f in faults):
            return faults
        ft = job.spec["fault_tolerance"]
        limit, window = ft.get("collateral_limit", 3), ft.get("collateral_window_s", 900.0)
        first = min(faults, key=lambda f: f.fault_at)
        h = self.s.store.r.hgetall(self._health_key(first.worker))
        strikes = [t for t in loads(h.get("strikes"), []) if now - t <= window] + [now]
        self.s.store.commit(Tx().hset(self._health_key(first.worker), {"strikes": strikes}), lease)
        if len(strikes) < limit:
            return faults
        blamed = health.Fault("RepeatedFailures", first.rank, first.worker, first.coord, first.fault_at,
                              f"{first.detail}; its rank exited first in {len(strikes)} failures of the "
                              f"whole world within {window:.0f}s (collateral_limit {limit}): the others "
                              f"fell with it")
        return [blamed if f is first else f for f in faults]

    def _quarantine(self, job: Job, faults: list[health.Fault], lease: str, now: float) -> list[dict]:
        """Keep each blamed worker out of the free pool until `quarantine_s` has passed and
        its agent's health probe passed after that (`admissible`)."""
        q = float(job.spec["fault_tolerance"].get("quarantine_s", 60.0))
        out, tx = [], Tx()
        for f in faults:
            if f.cause not in QUARANTINED or f.worker in {o["worker"] for o in out}:
                continue
            until = now + q
            out.append({"worker": f.worker, "until": until, "cause": f.cause})
            msg = (f"worker {f.worker} quarantined for {q:.0f}s ({f.cause} of rank {f.rank}); it returns "
                   f"to the pool only after its health probe (matmul + gloo all-reduce) passes")
            tx.hset(self._health_key(f.worker), {"quarantined_until": until, "cause": f.cause,
                                                 "detail": f.detail, "job": job.id, "since": now})
            tx.event(self.s.k.job_events(job.id), self.s._event("Warning", "WorkerQuarantined", msg, now,
                                                                 job.generation))
            log.warning("job %s: %s", job.id, msg)
        if out:
            self.s.store.commit(tx, lease)
        return out

    def admissible(self, wids: list[str], now: float) -> list[str]:
        """`wids` without the quarantined: those inside their quarantine, and those past it
        whose agent has not yet reported a passing health probe taken after it ended."""
        if not wids:
            return wids
        pipe = self.s.store.r.pipeline(transaction=False)
        for w in wids:
            pipe.hget(self._health_key(w), "quarantined_until")
            pipe.hgetall(self.s.k.worker(w) + ":probe")
        got = pipe.execute()
        out = []
        for i, w in enumerate(wids):
            until, probe = float(got[2 * i] or 0), got[2 * i + 1] or {}
            if not until or (now >= until and probe.get("passed") == "1"
                             and float(probe.get("at") or 0) >= until):
                out.append(w)
        return out

    # -- the record ---------------------------------------------------------------------
    def _record(self, job: Job, ranks: list[dict], cause: str, faults: list[health.Fault], now: float) -> dict:
        return {"n": len(job.recoveries) + 1, "cause": cause, "faults": [f.to_json() for f in faults],
                "fault_at": min((f.fault_at for f in faults), default=now), "detected_at": now,
                "from_generation": job.generation, "last_step": max((r["step"] or 0 for r in ranks), default=0),
                "completed_at": None}

    def complete(self, job: Job, ranks: list[dict], lease: str, now: float) -> None:
        """Close the open record once every rank of its generation trained a step."""
        rec = job.open_recovery
        if rec is None or rec.get("to_generation") != job.generation:
            return
        if not ranks or any(not isinstance(r.get("first_step_at"), (int, float)) for r in ranks):
            return
        rdzv = max(r.get("rendezvous_at") or 0 for r in ranks)
        ready = max(r.get("ready_at") or 0 for r in ranks)
        first = max(r["first_step_at"] for r in ranks)
        start = min(r.get("start_step") or 0 for r in ranks)
        rec.update(
            completed_at=now, resumed_step=start, steps_lost=max(0, rec["last_step"] - start),
            durations={"detect_s": rec["detected_at"] - rec["fault_at"],
                       "decide_s": rec["decided_at"] - rec["detected_at"],
                       "rendezvous_s": rdzv - rec["decided_at"], "restore_s": ready - rdzv,
                       "first_step_s": first - ready, "total_s": first - rec["fault_at"]})
        d = rec["durations"]
        msg = (f"recovery {rec['n']} ({rec['cause']}, {rec['action']}) done in {d['total_s']:.1f}s: "
               + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in d.items() if k != "total_s")
               + f"; resumed at step {start}, {rec['steps_lost']} steps redone")
        job.set("Recovering", False, "Recovered", msg, now)
        job.set("Running", True, "Training", f"generation {job.generation}: all {len(ranks)} ranks training", now)
        tx = Tx().hset(self.s.k.job(job.id), job.fields())
        tx.event(self.s.k.job_events(job.id), self.s._event("Normal", "Recovered", msg, now, job.generation))
        self.s.store.commit(tx, lease)
        log.info("job %s: %s", job.id, msg)

    def hosts(self, wids: list[str]) -> dict[str, str]:
        infos = self.s.store.workers(wids)
        return {w: loads(infos[w].get("labels"), {}).get("host") or infos[w].get("host", "?") for w in wids}

    @staticmethod
    def _message(first: health.Fault, action: str, layout: Layout) -> str:
        c = first.coord
        what = f"rank {first.rank} (dp={c['dp']} pp={c['pp']} tp={c['tp']}) on {first.worker}: {first.detail}"
        if action == "replace":
            moves = ", ".join(f"{o} -> {n}" for o, n in layout.moved.items())
            return f"{what}; spare promoted into the same coordinates ({moves})"
        if action == "shrink":
            return f"{what}; no spare: dp shrinks to {layout.shape.dp}, global batch kept"
        return f"{what}; restarting the same mesh"


def _reason(action: str) -> str:
    return {"replace": "ReplacingRank", "shrink": "ShrinkingDP", "restart": "Restarting"}[action]
