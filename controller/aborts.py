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
ranks' count and runnable) nothing is blamed here, and the failures restart the world in place
(`TrainerFailed`, controller/health.py `collateral_only`).
"""

from __future__ import annotations

import signal

from controller.health import _entered, fault
from services.api import RankStatus
from services.assignment import FROZEN_PROC_STATES
from services.records import FaultRecord

LIVE = ("assigned", "starting", "running")


def watchdog_aborted(r: RankStatus) -> bool:
    return r.state == "failed" and r.exit_code == -signal.SIGABRT


def blame_after_aborts(ranks: list[RankStatus], now: float) -> list[FaultRecord]:
    """`RankHung` for the live ranks the aborted ones waited on; [] when nothing aborted or
    nothing tells which rank it was."""
    aborted = [r for r in ranks if watchdog_aborted(r)]
    live = [r for r in ranks if r.state in LIVE]
    if not aborted or not live:
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
    return [
        fault("RankHung", r, r.progress_at or now, f"{_evidence(r, top)}; {why}") for r in culprits
    ]


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
