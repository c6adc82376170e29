"""What one tenant's spec may ask of the shared pool (docs/security.md, "Tenants and the pool").

Some settings of a job act on workers every tenant shares: how long a blamed worker is kept
out (`fault_tolerance.quarantine_s`) and how eagerly a rank is called a straggler and its
worker quarantined (`straggler.slowdown`, `straggler.window_steps`). A submitter could
otherwise take a pool worker out for a week with one job. The operator bounds them
(`PoolLimits`, the controller's flags); a spec may only tighten them within those bounds, and
an admin token may go beyond. Each owner may also keep only so many jobs waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.auth import Principal
from services.spec import JobSpec, Problem


@dataclass(frozen=True)
class PoolLimits:
    max_quarantine_s: float = 3600.0
    """--max-quarantine: the longest quarantine a non-admin spec may ask for."""
    min_straggler_slowdown: float = 1.2
    """--min-straggler-slowdown: a non-admin spec's `straggler.slowdown` is at least this (with
    `action: replace`, a lower one quarantines workers for noise)."""
    min_straggler_window_steps: int = 5
    """--min-straggler-window: a non-admin spec judges stragglers over at least this many
    steps."""
    max_pending_jobs: int | None = 100
    """--max-pending-jobs: jobs one owner may have waiting to start (None: no cap)."""
    plan_concurrency: int = 2
    """--plan-concurrency: POST /v1/plan calls running at once (controller/plan_gate.py)."""
    plans_per_minute: int = 60
    """--plans-per-minute: POST /v1/plan calls one owner may start a minute."""


def limit_problems(spec: JobSpec, who: Principal, limits: PoolLimits) -> list[Problem]:
    """Where `spec` asks more of the shared pool than a non-admin may; empty for an admin."""
    if who.admin:
        return []
    ft, out = spec.fault_tolerance, []
    if ft.quarantine_s > limits.max_quarantine_s:
        out.append(
            Problem(
                "fault_tolerance.quarantine_s",
                f"{ft.quarantine_s:g}s is over this pool's bound of "
                f"{limits.max_quarantine_s:g}s (quarantine keeps a shared worker from every "
                "tenant); ask for less, or have an admin submit it",
            )
        )
    st = ft.straggler
    if st.action == "replace" and st.slowdown < limits.min_straggler_slowdown:
        out.append(
            Problem(
                "fault_tolerance.straggler.slowdown",
                f"{st.slowdown:g} is under this pool's floor of "
                f"{limits.min_straggler_slowdown:g} with action replace (a replaced straggler's "
                "worker is quarantined); raise it, or use action: report",
            )
        )
    if st.action == "replace" and st.window_steps < limits.min_straggler_window_steps:
        out.append(
            Problem(
                "fault_tolerance.straggler.window_steps",
                f"{st.window_steps} is under this pool's floor of "
                f"{limits.min_straggler_window_steps} steps with action replace; judge over "
                "more steps, or use action: report",
            )
        )
    return out


def pending_problem(owner: str, pending: int, limits: PoolLimits) -> Problem | None:
    """Why `owner`, with `pending` jobs already waiting, may not queue another."""
    cap = limits.max_pending_jobs
    if cap is None or pending < cap:
        return None
    return Problem(
        "(job)",
        f"owner {owner!r} already has {pending} jobs waiting to start (this pool's cap is "
        f"{cap}); wait for some to start, or cancel some",
    )
