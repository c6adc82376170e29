"""A job's goodput ledger (docs/architecture.md, "The goodput ledger"): its wall time since
admission, split into parts that add up to it, kept in Redis with the job (`goodput` of
`job:{jid}`, written in the pass's fenced transactions with the job's other fields).

Every second up to `Ledger.at` is charged to exactly one part, and a charge only moves `at`
forward: the parts sum to `at - submitted_at`, and no part ever shrinks (the Prometheus
counters are the parts). A pass that did not get to write is replayed from the stored ledger
and charges the same seconds again, to the same parts.

What a second was is known at once while the job holds no world (waiting, suspended,
preempted), and only later while it does:
- a *window* runs from `at` to a world's first step: a placement's start (charged as the wait
  or the stop before it), or a recovery, from its fault (`RecoveryRecord` `n`) to the first
  step of its new world (`durations.total_s`), split into the record's phases. Records are
  charged once each, by number: trimming old ones from the job loses nothing.
- training is charged only up to the oldest of its ranks' latest reports and their workers'
  latest beats. A fault is dated by a rank's exit, its last report or its worker's last
  beat, so none found later lies before that, and training time is never taken back for a
  recovery: the detection window is the recovery's alone.
Training time first pays the overheads rank 0 reported (`RankReport.overheads`: checkpoint
and snapshot blocking, eval; totals per generation, owed as they grow), then is redone while
the world is behind the furthest step the job reached (what a recovery or a stop lost), and
productive otherwise.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import Field

from controller.conditions import TERMINAL
from services import api
from services.records import RankReport, Record, RecoveryRecord

PARTS = (
    "productive_s",
    "redone_s",
    "recovery_s",
    "checkpoint_s",
    "snapshot_s",
    "eval_s",
    "waiting_s",
    "suspended_s",
)
PHASES = ("detect_s", "decide_s", "rendezvous_s", "restore_s", "first_step_s")
OVERHEADS = ("checkpoint_s", "snapshot_s", "eval_s")


def _zeros(names: tuple[str, ...]) -> dict[str, float]:
    return dict.fromkeys(names, 0.0)


class Ledger(Record):
    at: float  # every second from submission up to here is in `parts`
    parts: dict[str, float] = Field(default_factory=lambda: _zeros(PARTS))
    phases: dict[str, float] = Field(default_factory=lambda: _zeros(PHASES))  # of recovery_s
    # the span from `at`, charged when it ends: {"cause": "waiting_s" | "suspended_s",
    # "generation": G} (a placement, until G's first step) or {"cause": "recovery_s", "n": N}
    window: dict = {}
    counted: int = 0  # the newest recovery record charged (or whose window is open)
    owed: dict[str, float] = Field(default_factory=lambda: _zeros(OVERHEADS))
    reported: dict = {}  # rank 0's overhead totals already owed: {"generation", *OVERHEADS}
    # the world trains steps the job had done before; None: a world not judged yet
    behind: bool | None = False


class Accounted(Protocol):
    """What the ledger reads of a job (controller/jobs.py's `Job`)."""

    goodput: Ledger
    generation: int
    step: int
    submitted_at: float | None
    recoveries: list[RecoveryRecord]

    @property
    def phase(self) -> str: ...

    def condition(self, type_: str) -> dict | None: ...


# -- what the pass calls ----------------------------------------------------------------
def account(
    job: Accounted,
    now: float,
    ranks: list[api.RankStatus] | None = None,
    beats: dict[str, float] | None = None,
) -> None:
    """Charge what is known up to `now`, by the state the job has been in since `at`. Called
    for each job before its pass changes anything, which charges a job without a world; a
    world's time needs its rank view and its workers' beats, given by the second call."""
    led = job.goodput
    if job.phase in TERMINAL:
        return
    if cause := _idle(job):
        _charge(led, cause, now)
        return
    if not ranks:
        return  # a world's time is charged from its ranks' reports (controller/following.py)
    _records(led, job, now)
    _owe(led, job.generation, ranks[0] if ranks[0].rank == 0 else None)
    firsts = [r.first_step_at for r in ranks]
    if led.window.get("generation") == job.generation and all(firsts):
        _end(led, job, min(now, max(firsts)))
    behind = min(r.step for r in ranks) < _furthest(job)
    if led.behind is None:  # a world new since the last look: judged by its own steps
        led.behind = behind
    if not led.window and (until := _settled(ranks, beats or {}, now)) is not None:
        _train(led, until)
    led.behind = behind


def placed(job: Accounted, now: float) -> None:
    """A waiting job gets a world: its start, until the world's first step, is charged as what
    it waited as. A recovery that waited for workers goes on in its own window."""
    if cause := _idle(job):
        _charge(job.goodput, cause, now)
        job.goodput.window = {"cause": cause, "generation": job.generation + 1}


def stopped(job: Accounted, now: float, ranks: list[api.RankStatus] = ()) -> None:
    """The world stops now (the job ends, is suspended or preempted): what was open ends.
    Rank 0's last report (`ranks`, the final view) is owed first: the save a job ends or
    stops with is reported only as it exits, and unowed it would count as training."""
    if ranks and ranks[0].rank == 0 and not _idle(job):
        _owe(job.goodput, job.generation, ranks[0])
    _stop(job.goodput, job, now)


# -- what is read -------------------------------------------------------------------------
def view(job: Accounted, now: float) -> api.Goodput:
    """The ledger as if the world stopped now: an open window charged until now as it would be
    (a recovery by the phases known so far), training up to now as it stands."""
    led = job.goodput.model_copy(deep=True)
    _stop(led, job, now)
    wall = led.at - (job.submitted_at or led.at)
    usable = wall - led.parts["suspended_s"]
    return api.Goodput(
        wall_s=wall,
        ettr=led.parts["productive_s"] / usable if usable > 0 else None,
        parts=api.GoodputParts(**led.parts),
        recovery_phases=api.RecoveryPhases(**led.phases),
    )


def settled(job: Accounted, now: float) -> dict[str, float]:
    """The parts charged for good, never less than an earlier answer (the Prometheus
    counters): the stored ledger, plus the time since for a job that holds no world, which no
    later pass charges elsewhere."""
    parts = dict(job.goodput.parts)
    if job.phase not in TERMINAL and (cause := _idle(job)):
        parts[cause] += max(0.0, now - job.goodput.at)
    return parts


# -- the arithmetic ---------------------------------------------------------------------
def _idle(job: Accounted) -> str | None:
    """The part for time the job holds no world; None while it holds one, or waits for
    workers after a fault (its recovery's time)."""
    if job.phase == "Suspended":
        return "suspended_s"
    if job.phase != "Pending":
        return None
    preempted = (job.condition("Preempted") or {}).get("status") == "True"
    return "suspended_s" if preempted else "waiting_s"


def _stop(led: Ledger, job: Accounted, now: float) -> None:
    if job.phase in TERMINAL:
        return
    if cause := _idle(job):
        _charge(led, cause, now)
        return
    _records(led, job, now)
    _end(led, job, now)


def _charge(led: Ledger, part: str, until: float) -> None:
    if until > led.at:
        led.parts[part] += until - led.at
        led.at = until


def _records(led: Ledger, job: Accounted, now: float) -> None:
    """Open the window of each recovery not seen yet (what was open ends at its fault), and
    close the open one at its new world's first step once its record is complete."""
    for rec in job.recoveries:
        if rec.n > led.counted:
            _end(led, job, max(rec.fault_at, led.at))
            led.counted, led.window = rec.n, {"cause": "recovery_s", "n": rec.n}
        total = (rec.durations or {}).get("total_s")
        if led.window.get("n") == rec.n and rec.completed_at is not None and total is not None:
            _end(led, job, min(now, max(led.at, rec.fault_at + total)))


def _end(led: Ledger, job: Accounted, until: float) -> None:
    """End what runs from `at` at `until`: the window, else training."""
    window, until = led.window, max(until, led.at)
    if window.get("cause") == "recovery_s":
        rec = next(r for r in job.recoveries if r.n == window["n"])
        for phase, seconds in _phases(rec, led.at, until).items():
            led.phases[phase] += seconds
        _charge(led, "recovery_s", until)
    elif window:
        _charge(led, window["cause"], until)
    else:
        _train(led, until)
    if window:  # a new world trains from here
        led.window, led.behind = {}, None


def _phases(rec: RecoveryRecord, start: float, end: float) -> dict[str, float]:
    """[start, end] of recovery `rec` split at its phases' ends: detection, the decision, then
    the durations of a complete record. A phase whose end is not known yet (or was not
    reported) runs to `end`, the ones after it get nothing; the first step ends at `end`."""
    d = rec.durations or {}
    ends: list[float | None] = [rec.detected_at, rec.decided_at]
    for name in ("rendezvous_s", "restore_s"):
        ends.append(ends[-1] + d[name] if ends[-1] is not None and name in d else None)
    out, prev = {}, start
    for name, mark in zip(PHASES, [*ends, end], strict=True):
        upto = end if mark is None else min(end, max(prev, mark))
        out[name], prev = upto - prev, upto
    return out


def _owe(led: Ledger, generation: int, rank0: RankReport | None) -> None:
    """What rank 0's totals grew by since the last look is owed to their parts."""
    if rank0 is None:
        return
    if led.reported.get("generation") != generation:
        led.reported = {"generation": generation, **_zeros(OVERHEADS)}
    for part in OVERHEADS:
        total = getattr(rank0.overheads, part)
        led.owed[part] += max(0.0, total - led.reported[part])
        led.reported[part] = max(total, led.reported[part])


def _train(led: Ledger, until: float) -> None:
    span = max(0.0, until - led.at)
    for part in OVERHEADS:
        paid = min(led.owed[part], span)
        led.parts[part] += paid
        led.owed[part] -= paid
        span -= paid
    led.parts["redone_s" if led.behind else "productive_s"] += span
    led.at = max(led.at, until)


def _settled(ranks: list[api.RankStatus], beats: dict[str, float], now: float) -> float | None:
    """The oldest of the ranks' latest reports and their workers' latest beats (None while a
    rank has not reported): no fault found later can date from before it."""
    reports = [r.progress_at for r in ranks]
    if None in reports:
        return None
    return min(now, *reports, *(beats[r.worker] for r in ranks if r.worker in beats))


def _furthest(job: Accounted) -> int:
    """The furthest step the job reached: its own (the slowest rank's, which never goes back)
    or, where a fault struck, the furthest any rank had."""
    return max(job.step, job.recoveries[-1].last_step if job.recoveries else 0)
