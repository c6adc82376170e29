"""Blame beyond one recovery: collateral strikes and quarantine (docs/architecture.md,
"Failure handling").

A worker blamed for a fault the cause of which points at the worker itself (a hung rank, a
straggler, repeated collateral failures, a silent data corruption re-execution blamed on it)
is kept out of the free pool for the spec's `fault_tolerance.quarantine_s`, then re-admitted
only once its agent's health probe passed (worker/agent/probe.py). A trainer killed from
outside (TrainerKilled) or a silent host (WorkerDead, restarted by its pool) says nothing
about the worker's health. Whole-world failures with no root cause strike the worker whose
rank exited first; enough strikes and it is blamed too (controller/faults.py).

`worker:{wid}:health` is controller-written; the agent only reads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from controller.passes import Pass
from services.records import FaultRecord, Quarantine
from services.store import Keys, Store, Tx, loads

log = logging.getLogger("meshkeeper.recovery")
QUARANTINED = ("RankHung", "Straggler", "RepeatedFailures", "SilentDataCorruption")


@dataclass(frozen=True)
class Blame:
    """The writes about workers that come with a fault decision (in its transaction)."""

    strikes: dict[str, list[float]] = field(default_factory=dict)  # worker -> strike times
    quarantined: list[tuple[Quarantine, FaultRecord]] = field(default_factory=list)


def health_key(keys: Keys, wid: str) -> str:
    return keys.worker(wid) + ":health"


def strikes(store: Store, wid: str, window_s: float, now: float) -> list[float]:
    """The worker's collateral strikes within `window_s`, plus one now."""
    h = store.r.hgetall(health_key(store.keys, wid))
    return [t for t in loads(h.get("strikes"), []) if now - t <= window_s] + [now]


def quarantines(
    faults: list[FaultRecord], quarantine_s: float, now: float
) -> list[tuple[Quarantine, FaultRecord]]:
    """One quarantine per worker blamed for a cause in QUARANTINED, its first fault's."""
    out: list[tuple[Quarantine, FaultRecord]] = []
    for f in faults:
        if f.cause in QUARANTINED and f.worker not in {q.worker for q, _ in out}:
            out.append((Quarantine(worker=f.worker, until=now + quarantine_s, cause=f.cause), f))
    return out


def write(tx: Tx, ctx: Pass, jid: str, generation: int, blame: Blame) -> None:
    for wid, times in blame.strikes.items():
        tx.hset(health_key(ctx.keys, wid), {"strikes": times})
    for q, f in blame.quarantined:
        msg = (
            f"worker {q.worker} quarantined for {q.until - ctx.now:.0f}s ({q.cause} of rank "
            f"{f.rank}); it returns to the pool only after its health probe (matmul + gloo "
            f"all-reduce) passes"
        )
        tx.hset(
            health_key(ctx.keys, q.worker),
            {
                "quarantined_until": q.until,
                "cause": q.cause,
                "detail": f.detail,
                "job": jid,
                "since": ctx.now,
            },
        )
        tx.event(
            ctx.keys.job_events(jid), ctx.event("Warning", "WorkerQuarantined", msg, generation)
        )
        log.warning("job %s: %s", jid, msg)


def admissible(store: Store, wids: list[str], now: float) -> list[str]:
    """`wids` without the quarantined: those inside their quarantine, and those past it
    whose agent has not yet reported a passing health probe taken after it ended."""
    if not wids:
        return wids
    pipe = store.r.pipeline(transaction=False)
    for w in wids:
        pipe.hget(health_key(store.keys, w), "quarantined_until")
        pipe.hgetall(store.keys.worker(w) + ":probe")
    got = pipe.execute()
    out = []
    for i, w in enumerate(wids):
        until, probe = float(got[2 * i] or 0), got[2 * i + 1] or {}
        if not until or (
            now >= until and probe.get("passed") == "1" and float(probe.get("at") or 0) >= until
        ):
            out.append(w)
    return out
