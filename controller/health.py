"""Which ranks of a running job are faulty, and since when (DESIGN.md section 7).

Pure functions of the rank view (controller/ranks.py) and Redis server time `now`:
- a trainer killed by a signal, or a rank on a worker whose heartbeat is older than
  `dead_after_s`, is a root cause;
- a rank whose progress is frozen past `hang_after_s` while its worker heartbeats is hung
  (before its first report a longer start-up bound applies: import, rendezvous, restore);
- a rank whose own compute time (collective waits excluded) is above `slowdown` x the
  median on every one of the last `window_steps` steps is a straggler.
When one rank dies the others of its world fail soon after with collective errors; those
exits are collateral and are not blamed. Exits with a deterministic cause (bad spec or data,
non-finite loss) fail the job instead: a restart would only repeat them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from services.assignment import FROZEN_PROC_STATES

STARTUP_GRACE_S = 300.0  # per start-up milestone (import, rendezvous, restore): loaded hosts are slow
DETERMINISTIC_EXITS = {2: "invalid spec or data", 3: "non-finite loss or gradient"}
BLAMELESS = ("TrainerFailed", "JobStalled")  # restart the same workers: none is at fault


@dataclass(frozen=True)
class Fault:
    cause: str  # TrainerKilled | WorkerDead | RankHung | Straggler | TrainerFailed
    rank: int
    worker: str
    coord: dict
    fault_at: float
    detail: str

    def to_json(self) -> dict:
        return {"cause": self.cause, "rank": self.rank, "worker": self.worker, "coord": self.coord,
                "fault_at": self.fault_at, "detail": self.detail}


def _num(v, default: float) -> float:
    return float(v) if isinstance(v, (int, float)) else default


def dead_or_killed(ranks: list[dict], seen: dict[str, float] | None, dead_after_s: float,
                   now: float) -> list[Fault]:
    """`seen` None: heartbeats cannot be judged now (Redis itself just restarted)."""
    out = []
    for r in ranks:
        last_beat = seen.get(r["worker"], 0.0) if seen is not None else now
        if r["state"] not in ("succeeded",) and now - last_beat > dead_after_s:
            out.append(Fault("WorkerDead", r["rank"], r["worker"], r["coord"], last_beat,
                             f"worker {r['worker']} silent for {now - last_beat:.1f}s "
                             f"(dead_after_s {dead_after_s})"))
        elif r["state"] == "failed" and _num(r.get("exit_code"), 0) < 0:
            out.append(Fault("TrainerKilled", r["rank"], r["worker"], r["coord"],
                             _num(r.get("exited_at"), now), f"trainer killed by signal {-int(r['exit_code'])}"))
    return out


def deterministic_failure(ranks: list[dict]) -> str | None:
    """A message when a rank exited for a reason a restart would repeat."""
    for r in ranks:
        code = r.get("exit_code")
        if r["state"] == "failed" and code in DETERMINISTIC_EXITS:
            return (f"rank {r['rank']} exited with code {code} ({DETERMINISTIC_EXITS[code]}): "
                    f"{r.get('error') or 'see ' + str(r.get('log'))}")
    return None


def collateral_only(ranks: list[dict], now: float) -> list[Fault]:
    """Ranks that failed with an error and no root cause was found: restart them in place."""
    return [Fault("TrainerFailed", r["rank"], r["worker"], r["coord"], _num(r.get("exited_at"), now),
                  f"trainer exited with code {r.get('exit_code')}")
            for r in ranks if r["state"] == "failed"]


def hung(ranks: list[dict], hang_after_s: float, now: float) -> list[Fault]:
    out = []
    for r in ranks:
        if r["state"] not in ("starting", "running", "assigned"):
            continue
        since = r.get("progress_at")
        bound = hang_after_s if r.get("first_step_at") else max(hang_after_s, STARTUP_GRACE_S)
        if isinstance(since, (int, float)) and now - since > bound:
            out.append(Fault("RankHung", r["rank"], r["worker"], r["coord"], since,
                             f"no progress for {now - since:.1f}s at step {r.get('step')} "
                             f"(bound {bound:.0f}s) while its worker heartbeats"))
    return out


def hangs(ranks: list[dict], hang_after_s: float, now: float) -> list[Fault]:
    """Hung ranks, blamed with care: in synchronous training one frozen rank freezes all the
    others (they wait for it in a collective), so progress alone cannot tell which it is.
    - A rank whose process cannot run (stopped, stuck in I/O) is the cause.
    - Every rank frozen and none of them stopped: a job-wide stall (slow storage, a
      collective stuck after a network blip): restart in place rather than blame everyone.
    - Only some frozen: the others are about to freeze too; blame the frozen ones only if
      the rest still progress after twice the bound (truly independent hangs)."""
    found = hung(ranks, hang_after_s, now)
    if not found:
        return []
    by_rank = {f.rank: f for f in found}
    frozen = [r for r in ranks if r.get("proc_state") in FROZEN_PROC_STATES
              and r["state"] in ("starting", "running")]
    if frozen:
        return [Fault("RankHung", r["rank"], r["worker"], r["coord"],
                      _num(r.get("progress_at"), now),
                      (by_rank[r["rank"]].detail if r["rank"] in by_rank else "no progress")
                      + f"; its process is {FROZEN_PROC_STATES[r['proc_state']]}")
                for r in frozen]
    if len(by_rank) == len(ranks):
        f = min(found, key=lambda f: f.fault_at)
        return [Fault("JobStalled", f.rank, f.worker, f.coord, f.fault_at, f"all {len(ranks)} ranks: {f.detail}")]
    return [f for f in found if now - f.fault_at > 2 * hang_after_s]


def straggler(ranks: list[dict], slowdown: float, window: int, now: float) -> Fault | None:
    """The slowest rank if it stayed above slowdown x the median for the whole window: even
    its fastest step of the last `window_steps` (`compute_min`) took longer than slowdown x
    the median rank's mean step. A windowed mean alone flags healthy ranks on a shared host:
    a burst of run-queue noise (2-3 slow steps out of 5) lifts one rank's mean past 1.5x, and
    it is replaced, then its replacement too (seen in tests/chaos; comparing its fastest step
    with the others' fastest also flagged one). A rank slowed by contention is slow on every
    step, by far more."""
    full = [r for r in ranks if r["state"] == "running" and (r.get("window_n") or 0) >= window
            and isinstance(r.get("compute_avg"), (int, float))]
    if len(full) < 2 or len(full) < len(ranks):
        return None

    def fastest(r: dict) -> float:
        return r["compute_min"] if isinstance(r.get("compute_min"), (int, float)) else r["compute_avg"]

    median = statistics.median(r["compute_avg"] for r in full)
    worst = max(full, key=fastest)
    if median <= 0 or fastest(worst) <= slowdown * median:
        return None
    return Fault("Straggler", worst["rank"], worst["worker"], worst["coord"], now,
                 f"compute at least {fastest(worst) * 1e3:.0f} ms on each of the last {window} steps "
                 f"(mean {worst['compute_avg'] * 1e3:.0f} ms) is {fastest(worst) / median:.2f}x the "
                 f"median rank's mean {median * 1e3:.0f} ms (bound {slowdown}x)")
