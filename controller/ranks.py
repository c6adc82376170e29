"""Every rank's state, joined from the assignment and the agents' progress reports.

Reports from another job or an older generation are ignored (DESIGN.md section 5).
"""

from __future__ import annotations

from services.assignment import FINAL_RANK_STATES, Assignment
from services.store import loads

REPORTED = ("step", "loss", "tokens_per_s", "step_s", "compute_s", "wait_s", "pid", "exit_code",
            "error", "log", "started_at", "exited_at", "rendezvous_at", "ready_at", "start_step",
            "first_step_at", "progress_at", "compute_avg", "compute_min", "window_n", "proc_state",
            "coll_entered", "coll_left", "cpu_busy", "peak_rss", "oom")  # blame: controller/health.py


def rank_view(asg: Assignment, progress: dict[str, dict[str, str]],
              alive: set[str] | None = None) -> list[dict]:
    """One dict per rank: rank, coord, worker, state, and the latest step report."""
    reports: dict[str, dict] = {}
    for wid, p in progress.items():
        if p.get("job") == asg.job and p.get("generation") == str(asg.generation):
            reports[wid] = loads(p.get("ranks"), {})
    out = []
    for r in asg.ranks:
        rec = reports.get(r.wid, {}).get(str(r.rank), {})
        state = rec.get("state", "assigned")
        if alive is not None and r.wid not in alive and state not in FINAL_RANK_STATES:
            state = "lost"
        out.append({"rank": r.rank, "coord": r.coord._asdict(), "worker": r.wid,
                    "local_rank": r.local_rank, "state": state,
                    **{k: rec.get(k) for k in REPORTED}})
    return out


def summarize(ranks: list[dict]) -> dict:
    """Job-level progress: the slowest rank's step; loss and speed as rank 0 reports them
    (the trainer all-reduces the loss, so every rank holds the global value)."""
    if not ranks:
        return {}
    head = ranks[0]
    return {"step": min(r["step"] or 0 for r in ranks), "loss": head["loss"],
            "tokens_per_s": head["tokens_per_s"], "step_s": head["step_s"]}
