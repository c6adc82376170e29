"""Blame beyond one recovery: collateral strikes and quarantine (docs/architecture.md,
"Failure handling").

A worker blamed for a fault the cause of which points at the worker itself (a hung rank, a
straggler, repeated collateral failures, a silent data corruption re-execution blamed on it,
a device error)
is kept out of the free pool for the spec's `fault_tolerance.quarantine_s`, then re-admitted
only once its agent's health probe passed (worker/agent/probe.py). A trainer killed from
outside (TrainerKilled) or a silent host (WorkerDead, restarted by its pool) says nothing
about the worker's health. Whole-world failures with no root cause strike the worker whose
rank exited first; enough strikes and it is blamed too (controller/faults.py).

`worker:{wid}:health` is controller-written; the agent only reads it.

A quarantine is also kept by node (`node:{host}:health`, the worker's `host` label: the
Kubernetes node, or the machine). A worker id new to the pool that joins on such a node
takes the node's quarantine as its own (`inherit`): on Kubernetes a quarantined worker's pod
is replaced, and its Deployment's new pod, with a new id, may land on the same bad node; it
stays out of the pool until its own health probe passes after the quarantine's end. A rejoin
of a known id keeps its own record; a node whose quarantined worker has passed its probe
since is clear.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from controller.passes import Pass
from services.records import FaultRecord, Quarantine
from services.store import Keys, Store, Tx, loads

log = logging.getLogger("meshkeeper.recovery")
QUARANTINED = (
    "RankHung",
    "Straggler",
    "RepeatedFailures",
    "SilentDataCorruption",
    "DeviceError",
)


@dataclass(frozen=True)
class Blame:
    """The writes about workers that come with a fault decision (in its transaction)."""

    strikes: dict[str, list[float]] = field(default_factory=dict)  # worker -> strike times
    quarantined: list[tuple[Quarantine, FaultRecord]] = field(default_factory=list)


def health_key(keys: Keys, wid: str) -> str:
    return keys.worker(wid) + ":health"


def node_key(keys: Keys, host: str) -> str:
    return f"{keys.prefix}node:{host}:health"


def node_of(info: dict[str, str]) -> str:
    """A registration's node: its `host` label (the join sets it), else its `host` field."""
    return loads(info.get("labels"), {}).get("host") or info.get("host", "?")


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
        record = {
            "quarantined_until": q.until,
            "cause": q.cause,
            "detail": f.detail,
            "job": jid,
            "since": ctx.now,
        }
        tx.hset(health_key(ctx.keys, q.worker), record)
        node = node_of(ctx.store.workers([q.worker])[q.worker])
        tx.hset(node_key(ctx.keys, node), {**record, "worker": q.worker})
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


def inherit(store: Store, wid: str, host: str) -> dict[str, str] | None:
    """Before a join registers `wid` on node `host`: a new id takes the node's quarantine
    (its end, cause and the worker it was for), so its agent probes once it is over. None
    when the id is known (a rejoin) or the node has none. Returns what was written."""
    if store.r.exists(store.keys.worker(wid)):
        return None
    node = store.r.hgetall(node_key(store.keys, host))
    until = float(node.get("quarantined_until") or 0)
    if not until:
        return None
    probe = store.r.hgetall(store.keys.worker(node.get("worker", "")) + ":probe")
    if probe.get("passed") == "1" and float(probe.get("at") or 0) >= until:
        store.r.delete(node_key(store.keys, host))  # the node passed once its quarantine ended
        return None
    record = {
        "quarantined_until": node["quarantined_until"],
        "cause": "NodeQuarantined",
        "detail": f"node {host} was quarantined for {node.get('cause')} of worker "
        f"{node.get('worker')}: {node.get('detail', '')}",
        "job": node.get("job", ""),
        "since": store.now(),
    }
    store.r.hset(health_key(store.keys, wid), mapping=record)
    return record
