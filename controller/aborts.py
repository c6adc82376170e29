"""Ranks the NCCL watchdog aborted, and the rank they were waiting for (docs/architecture.md,
"Failure handling").

On NCCL, a collective that does not complete within the process group's timeout (aligned with
`hang_after_s`, worker/trainer/distributed.py) makes the watchdog of every rank waiting in it
tear its process down: TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's default, ends the process
with std::abort, so its agent sees SIGABRT. Those ranks were killed by their own side, not by
anything outside: they are collateral, and reading them as `TrainerKilled` replaced every
healthy worker while the rank that caused it stayed unblamed.

The cause is the rank they waited for: one that stopped entering collectives. Its watchdog
has nothing pending, so it lives on, stuck. Collective progress (worker/progress.py) names it:
every rank runs the same collective phases in the same order, and the aborted ranks last
reported more phases entered than it did. A rank whose process cannot run (stopped, stuck in
I/O) is the cause too. When neither tells (every rank aborted, or the live ones at the aborted
ranks' count and runnable), the aborted ranks' flight-recorder dumps may (worker/
flight_record.py): a rank whose GPU is stuck in a kernel queued the same collectives as its
peers, so it entered as many phases, and it aborts too, its own next collective timed out
unstarted. In a process group whose dumps disagree, the rank the others wait on is the one
furthest behind: the lowest last completed sequence number, and at the same number, a next
collective that never started on its device while the others' did. When nothing tells,
nothing is blamed here, and the failures restart the world in place (`TrainerFailed`,
controller/health.py `collateral_only`).
"""

from __future__ import annotations

import signal

from controller.health import _entered, fault
from services.api import RankStatus
from services.assignment import FROZEN_PROC_STATES
from services.records import FaultRecord

LIVE = ("assigned", "starting", "running")
# How long after the first watchdog abort the rest may still come, when nothing has named a
# rank yet: every rank's collective timed out within about a step of the others', and each
# watchdog waits 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (at most 4 s) before it aborts, so a
# rank whose GPU hung aborts, with its dump, within seconds of its peers.
ABORT_SETTLE_S = 8.0


def watchdog_aborted(r: RankStatus) -> bool:
    return r.state == "failed" and r.exit_code == -signal.SIGABRT


def blame_after_aborts(ranks: list[RankStatus], now: float) -> list[FaultRecord]:
    """`RankHung` for the live ranks the aborted ones waited on; [] when nothing aborted or
    nothing tells which rank it was."""
    aborted = [r for r in ranks if watchdog_aborted(r)]
    live = [r for r in ranks if r.state in LIVE]
    if not aborted:
        return []
    top = max(_entered(r) for r in aborted)
    behind = [r for r in live if _entered(r) < top]
    low = min((_entered(r) for r in behind), default=top)
    culprits = [r for r in behind if _entered(r) == low] or [
        r for r in live if r.proc_state in FROZEN_PROC_STATES
    ]
    why = (
        f"the NCCL watchdog aborted rank(s) {sorted(r.rank for r in aborted)} (SIGABRT) "
        f"waiting in collective phase {top}"
    )
    if not culprits:
        return [
            fault("RankHung", r, r.exited_at or now, f"{detail}; {why}")
            for r, detail in behind_in_flight(aborted)
        ]
    return [
        fault("RankHung", r, r.progress_at or now, f"{_evidence(r, top)}; {why}") for r in culprits
    ]


def settling(ranks: list[RankStatus], now: float) -> bool:
    """Some ranks were aborted by their watchdog less than ABORT_SETTLE_S ago and others still
    run: wait for their aborts and dumps before restarting a world nobody was blamed for."""
    aborted = [r.exited_at or now for r in ranks if watchdog_aborted(r)]
    live = any(r.state in LIVE for r in ranks)
    return bool(aborted) and live and now - min(aborted) < ABORT_SETTLE_S


def behind_in_flight(ranks: list[RankStatus]) -> list[tuple[RankStatus, str]]:
    """The ranks the others waited on by their flight-recorder dumps, with the evidence: in
    each process group two or more dumps name, those at the lowest (last completed, next one
    started) position when some other rank is further on. [] when no group's dumps differ."""
    found: dict[int, tuple[RankStatus, str]] = {}
    groups = sorted({g for r in ranks for g in (r.flight or {})}, key=str)
    for g in groups:
        at = {r.rank: (r, r.flight[g]) for r in ranks if r.flight and g in r.flight}
        if len(at) < 2:
            continue
        where = {n: _position(entry) for n, (_, entry) in at.items()}
        low = min(where.values())
        if low == max(where.values()):
            continue
        ahead = next(n for n, p in where.items() if p != low)
        for n, p in where.items():
            if p == low and n not in found:
                r, entry = at[n]
                found[n] = (r, _flight_evidence(g, entry, at[ahead][1], ahead))
    return [found[n] for n in sorted(found)]


def _position(entry: dict) -> tuple[int, int]:
    """How far a rank got in one group: its last completed collective, then whether the next
    one (if it is the very next) had started on its device."""
    completed = int(entry.get("completed") or 0)
    started = entry.get("pending") == completed + 1 and entry.get("state") == "started"
    return completed, int(started)


def _flight_evidence(group: str, entry: dict, other: dict, other_rank: int) -> str:
    desc = f"{group} ({entry['desc']})" if entry.get("desc") else group
    return (
        f"flight recorder, process group {desc}: it {_progress(entry)}; rank {other_rank} "
        f"{_progress(other)}"
    )


def _progress(entry: dict) -> str:
    out = f"completed collective #{entry.get('completed') or 0}"
    if entry.get("pending") is not None:
        op = f" ({entry['op']})" if entry.get("op") else ""
        out += f", #{entry['pending']}{op} {entry.get('state')}"
    return out


def _evidence(r: RankStatus, top: int) -> str:
    out = []
    if _entered(r) < 0:
        out.append("it never reported collective progress")
    elif _entered(r) < top:
        out.append(
            f"it stopped entering collectives: entered {r.coll_entered} collective phases "
            f"and left {r.coll_left}"
        )
    if r.proc_state in FROZEN_PROC_STATES:
        out.append(f"its process is {FROZEN_PROC_STATES[r.proc_state]}")
    return "; ".join(out)
