"""Which ranks of a running job are faulty, and since when (docs/architecture.md, "Failure
handling").

Pure functions of the rank view (controller/ranks.py, `RankStatus` per rank) and Redis
server time `now`; each fault found is a `FaultRecord` (services/records.py):
- a trainer killed by a signal (not SIGABRT: a process that aborted itself, as the NCCL
  watchdog does, is collateral; controller/aborts.py), or a rank on a worker whose heartbeat
  is older than `dead_after_s`, is a root cause;
- a rank whose progress is frozen past `hang_after_s` while its worker heartbeats is hung
  (before its first report a longer start-up bound applies: import, rendezvous, restore);
- a rank whose own compute time (collective waits excluded) is above `slowdown` x the
  median on every one of the last `window_steps` steps is a straggler.
When one rank dies the others of its world fail soon after with collective errors; those
exits are collateral and are not blamed. Exits with a deterministic cause (bad spec or data,
non-finite loss, an OOM kill) fail the job instead: a restart would only repeat them.
Silent data corruption is the trainers' own finding (exit code 4 with the evidence in the
report's `sdc`): the ranks re-execution blamed are faulty, the others' exits are collateral.

Hangs are blamed by collective progress (worker/progress.py): each rank reports how many of
its steps' collective phases it entered and left. The ranks waiting inside a collective have
entered more than the rank they wait for.
"""

from __future__ import annotations

import signal
import statistics

from services.api import RankStatus
from services.assignment import FROZEN_PROC_STATES
from services.hang_bounds import hang_bound_s
from services.records import EXIT_DEVICE, FaultRecord

DETERMINISTIC_EXITS = {
    2: "invalid spec or data",
    3: "non-finite loss or gradient",
    5: "out of memory",  # worker/trainer/oom.py: a spare has the same memory
}
EXIT_OOM = 5
# restart the same workers: none is at fault (or, for a corruption re-execution could not
# attribute, none can be named without quarantining healthy ones)
BLAMELESS = ("TrainerFailed", "JobStalled", "SilentDataCorruptionUnattributed")


def fault(
    cause: str, r: RankStatus, fault_at: float, detail: str, evidence: dict | None = None
) -> FaultRecord:
    return FaultRecord(
        cause=cause,
        rank=r.rank,
        worker=r.worker,
        coord=r.coord.model_dump(),
        fault_at=fault_at,
        detail=detail,
        evidence=evidence,
    )


def _num(v: float | None, default: float) -> float:
    return default if v is None else float(v)


def dead_or_killed(
    ranks: list[RankStatus], seen: dict[str, float] | None, dead_after_s: float, now: float
) -> list[FaultRecord]:
    """`seen` None: heartbeats cannot be judged now (Redis itself just restarted)."""
    out = []
    for r in ranks:
        # SIGABRT: the process ended itself (the NCCL watchdog's abort): controller/aborts.py
        aborted = r.exit_code == -signal.SIGABRT
        last_beat = seen.get(r.worker) if seen is not None else now
        if r.state != "succeeded" and last_beat is None:
            # no beat at all: its agent deregistered (a clean stop removes its beat). It left
            # when its ranks last reported, not at the epoch.
            left = r.exited_at or r.progress_at or now
            out.append(fault("WorkerDead", r, left, f"worker {r.worker} stopped (deregistered)"))
        elif r.state != "succeeded" and now - last_beat > dead_after_s:
            out.append(
                fault(
                    "WorkerDead",
                    r,
                    last_beat,
                    f"worker {r.worker} silent for {now - last_beat:.1f}s "
                    f"(dead_after_s {dead_after_s})",
                )
            )
        elif r.state == "failed" and r.exit_code is not None and r.exit_code < 0 and not aborted:
            out.append(
                fault(
                    "TrainerKilled",
                    r,
                    _num(r.exited_at, now),
                    f"trainer killed by signal {-r.exit_code}",
                )
            )
    return out


def silent_corruption(ranks: list[RankStatus], now: float) -> list[FaultRecord]:
    """The faults of a silent data corruption the trainers found (docs/architecture.md,
    "Silent data corruption"): one `SilentDataCorruption` per rank that re-execution blamed
    (its worker is quarantined and the rank moves to a spare). When re-execution could not
    tell (no suspect), one `SilentDataCorruptionUnattributed` per rank whose fingerprint
    disagreed: blameless, the world restarts in place from the newest checked state, since
    blaming every disagreeing rank would quarantine healthy workers. Empty: no report."""
    reporting = [r for r in ranks if r.sdc]
    if not reporting:
        return []
    first = min(reporting, key=lambda r: (_num(r.exited_at, now), r.rank))
    evidence = first.sdc or {}
    at = _num(first.exited_at, now)
    by_rank = {r.rank: r for r in ranks}
    suspects = [by_rank[n] for n in _rank_list(evidence.get("suspects")) if n in by_rank]
    tensor, at_step = evidence.get("tensor", "a tensor"), evidence.get("step")
    if evidence.get("check") == "spot":  # worker/trainer/spot_check.py
        found = (
            f"re-executing one microbatch gave a different {tensor} on ranks "
            f"{_rank_list(evidence.get('ranks'))} at the spot check of step {at_step}"
        )
    elif evidence.get("check") == "at_rest":  # worker/trainer/at_rest.py
        found = (
            f"{tensor} changed at rest on ranks {_rank_list(evidence.get('ranks'))} after the "
            f"update of step {at_step}"
        )
    else:
        found = (
            f"fingerprints of {tensor} disagree between ranks "
            f"{_rank_list(evidence.get('ranks'))} at the check of step {at_step}"
        )
    rollback = f"rolling back to step {evidence.get('clean_step')}, the newest checked state"
    told = f": {evidence['detail']}" if evidence.get("detail") else ""
    blamer = "its own state check" if evidence.get("check") == "at_rest" else "re-execution"
    if suspects:
        return [
            fault(
                "SilentDataCorruption",
                r,
                at,
                f"{found}; {blamer} blames rank {r.rank}; {rollback}{told}",
                evidence,
            )
            for r in suspects
        ]
    disagreeing = [by_rank[n] for n in _rank_list(evidence.get("ranks")) if n in by_rank]
    return [
        fault(
            "SilentDataCorruptionUnattributed",
            r,
            at,
            f"{found}; re-execution could not tell which rank is wrong, so nobody is blamed: "
            f"restarting in place, {rollback}{told}",
            evidence,
        )
        for r in disagreeing or [first]
    ]


def corruption_pending(ranks: list[RankStatus], bound_s: float, now: float) -> bool:
    """A rank reported a corruption and others still run, for less than `bound_s`: they found
    the same mismatch in the same collective and are exiting with the same evidence after
    dropping their unchecked snapshots. A new generation now would stop them before that, and
    the restore could agree on an unchecked (corrupt) step."""
    reported = [_num(r.exited_at, now) for r in ranks if r.sdc]
    running = any(r.state in ("assigned", "starting", "running") for r in ranks)
    return bool(reported) and running and now - min(reported) < bound_s


def _rank_list(value: object) -> list[int]:
    """Rank numbers from the trainer's evidence; anything else in it is ignored."""
    items = value if isinstance(value, list) else []
    return [n for n in items if isinstance(n, int) and not isinstance(n, bool)]


def deterministic_failure(ranks: list[RankStatus]) -> tuple[str, str] | None:
    """(the job's Failed reason, a message) when a rank exited for a reason a restart would
    repeat: OutOfMemory for an allocator's out-of-memory, else TrainerFailed."""
    for r in ranks:
        code = r.exit_code
        if r.state == "failed" and code in DETERMINISTIC_EXITS:
            reason = "OutOfMemory" if code == EXIT_OOM else "TrainerFailed"
            return reason, (
                f"rank {r.rank} exited with code {code} ({DETERMINISTIC_EXITS[code]}): "
                f"{r.error or 'see ' + str(r.log)}"
            )
    return None


def _mib(n: object) -> str:
    return f"{n / 2**20:,.0f} MiB" if isinstance(n, (int, float)) and n > 0 else "unknown"


def out_of_memory(ranks: list[RankStatus]) -> str | None:
    """A message when the kernel OOM-killed a rank's trainer (its agent read the trainer's
    memory cgroup oom_kill count rise, with exit status SIGKILL). A spare has the same memory,
    so replacing or restarting would only be killed again: the job fails, naming the fix."""
    for r in ranks:
        oom = r.oom
        if r.state == "failed" and isinstance(oom, dict):
            c = r.coord
            limit = f", memory cgroup limit {_mib(oom.get('limit'))}" if oom.get("limit") else ""
            peak = _mib(oom.get("peak_rss") or r.peak_rss)
            return (
                f"rank {r.rank} (dp={c.dp} pp={c.pp} tp={c.tp}) on worker {r.worker} "
                f"was killed by the kernel OOM killer: peak memory (RSS) {peak}"
                f"{limit} (evidence: {oom.get('evidence', 'oom_kill counter')}). Fewer "
                f"parameters and optimizer state per rank fix it: raise parallel.pp or "
                f"parallel.tp, use parallel.zero 3, or run on workers with more memory"
            )
    return None


def device_errors(ranks: list[RankStatus], now: float) -> list[FaultRecord]:
    """Ranks whose trainer exited because its device failed (a CUDA error: its context is
    lost). The device is the cause, so its worker is blamed, replaced and quarantined; the
    other ranks' failures are collateral. `evidence` holds the failed step (the one after the
    rank's last completed) and NVML's view of the GPU, where the agent has one."""
    return [
        fault(
            "DeviceError",
            r,
            _num(r.exited_at, now),
            f"device error during step {r.step + 1}; {exited(r)}"
            + (f"; NVML: {_nvml(r.device)}" if r.device else ""),
            {"step": r.step + 1, **({"nvml": r.device} if r.device else {})},
        )
        for r in ranks
        if r.state == "failed" and r.exit_code == EXIT_DEVICE
    ]


def _nvml(device: dict) -> str:
    parts = [
        f"{k} {device[k]}"
        for k in ("xids", "ecc_uncorrected", "remap_pending", "remap_failed", "lost", "unread")
        if device.get(k)
    ]
    return ", ".join(parts) or "no Xid, ECC or row-remapping error"


def collateral_only(
    ranks: list[RankStatus], now: float, seen: dict[str, float] | None = None
) -> list[FaultRecord]:
    """Ranks that failed with an error and no root cause was found: restart them in place.

    Not while a worker of the job has been silent since the first failure (`seen`: last
    beats): a peer whose host died makes the others fail within milliseconds, long before
    `dead_after_s` names it, and a restart in place would land on the dead worker and cost a
    second recovery. Every live agent beats within its heartbeat interval, so this waits at
    most that long, or until `dead_or_killed` blames the silent one."""
    failed = [r for r in ranks if r.state == "failed"]
    if failed and seen is not None:
        first = min(_num(r.exited_at, now) for r in failed)
        if any(seen.get(r.worker, float("-inf")) < first for r in ranks):
            return []
    return [fault("TrainerFailed", r, _num(r.exited_at, now), exited(r)) for r in failed]


def exited(r: RankStatus) -> str:
    """'trainer exited with code N', and the last line of its log (the exception, usually)."""
    last = (r.error or "").strip().rpartition("\n")[2]
    return f"trainer exited with code {r.exit_code}" + (f": {last[:300]}" if last else "")


def hung(
    ranks: list[RankStatus], hang_after_s: float, now: float, params: int
) -> list[FaultRecord]:
    """Ranks silent past their bound (services/hang_bounds.py): `params`, the model's size,
    sets the start-up grace."""
    out = []
    for r in ranks:
        if r.state not in ("starting", "running", "assigned"):
            continue
        since = r.progress_at
        bound = hang_bound_s(hang_after_s, r.first_step_at is not None, params)
        if since is not None and now - since > bound:
            out.append(
                fault(
                    "RankHung",
                    r,
                    since,
                    f"no progress for {now - since:.1f}s at step {r.step} "
                    f"(bound {bound:.0f}s) while its worker heartbeats",
                )
            )
    return out


def _entered(r: RankStatus) -> int:
    """Collective phases entered; -1 for a rank that never reported any (no trainer file yet,
    or no report from its agent at all): it is behind every rank that entered one."""
    return -1 if r.coll_entered is None else r.coll_entered


def waited_on(ranks: list[RankStatus]) -> tuple[list[RankStatus], str] | None:
    """The ranks a hung world waits for, by collective progress, and why; None when the
    counters do not tell (nobody inside a collective, or every rank at the same count).

    Each rank runs the same collective phases in the same order, so in a hang the ranks
    inside a collective (entered > left) sit at the highest count, and the rank they wait on
    has entered fewer: it is spinning, computing or stuck before its next collective. The
    lowest count is blamed (ranks in between are waiting in an earlier collective of a
    subgroup, on it)."""
    live = [r for r in ranks if r.state in ("assigned", "starting", "running")]
    if len(live) < 2:
        return None
    top = max(_entered(r) for r in live)
    inside = [r for r in live if _entered(r) == top and (r.coll_left or 0) < top]
    if top <= 0 or not inside:
        return None
    low = min(_entered(r) for r in live)
    if low == top:
        return None
    behind = [r for r in live if _entered(r) == low]
    what = (
        "never reported collective progress"
        if low < 0
        else (f"entered {low} collective phases and left {behind[0].coll_left}")
    )
    return behind, (
        f"{what}, while rank(s) {sorted(r.rank for r in inside)} wait inside collective phase {top}"
    )


def busy_while_others_wait(ranks: list[RankStatus]) -> list[RankStatus]:
    """Every rank at the same collective count, some burning a core while the rest sleep:
    the busy ones are stuck in their own code inside the phase (the others wait in the
    phase's next collective, which sleeps). Empty when all or none are busy."""
    live = [r for r in ranks if r.state in ("starting", "running")]
    busy = [r for r in live if r.cpu_busy is True]
    idle = [r for r in live if r.cpu_busy is False and r.proc_state == "S"]
    return busy if busy and idle and len(busy) + len(idle) == len(live) else []


def hangs(
    ranks: list[RankStatus], hang_after_s: float, now: float, params: int
) -> list[FaultRecord]:
    """Hung ranks, blamed with care: in synchronous training one frozen rank freezes all the
    others (they wait for it in a collective), so progress alone cannot tell which it is.
    - A rank whose process cannot run (stopped, stuck in I/O) is the cause.
    - Otherwise (processes runnable or sleeping) the rank the others wait on: the one with
      the fewest collective phases entered, or none reported at all (`waited_on`); at equal
      counts, a rank spinning on a core while the others sleep in the collective.
    - Every rank frozen and nothing tells them apart: a job-wide stall (slow storage, a
      collective stuck after a network blip): restart in place rather than blame everyone.
    - Only some frozen: the others are about to freeze too; blame the frozen ones only if
      the rest still progress after twice the bound (truly independent hangs)."""
    found = hung(ranks, hang_after_s, now, params)
    if not found:
        return []
    by_rank = {f.rank: f for f in found}
    since = min(f.fault_at for f in found)

    def blame(r: RankStatus, why: str) -> FaultRecord:
        base = by_rank[r.rank].detail if r.rank in by_rank else "no progress"
        return fault("RankHung", r, _num(r.progress_at, since), f"{base}; {why}")

    frozen = [
        r
        for r in ranks
        if r.proc_state in FROZEN_PROC_STATES and r.state in ("starting", "running")
    ]
    if frozen:
        return [blame(r, f"its process is {FROZEN_PROC_STATES[r.proc_state]}") for r in frozen]
    waited = waited_on(ranks)
    if waited:
        behind, why = waited
        return [blame(r, f"the others wait on it: it {why}") for r in behind]
    spinning = busy_while_others_wait(ranks) if len(by_rank) == len(ranks) else []
    if spinning:
        return [
            blame(
                r,
                f"it keeps a CPU busy (state {r.proc_state}) at collective phase "
                f"{r.coll_entered} while the others sleep in it",
            )
            for r in spinning
        ]
    if len(by_rank) == len(ranks):
        f = min(found, key=lambda f: f.fault_at)
        return [
            f.model_copy(
                update={
                    "cause": "JobStalled",
                    "detail": f"all {len(ranks)} ranks: {f.detail}, all at collective phase "
                    f"{ {r.coll_entered for r in ranks} }",
                }
            )
        ]
    return [f for f in found if now - f.fault_at > 2 * hang_after_s]


def straggler(
    ranks: list[RankStatus], slowdown: float, window: int, now: float
) -> FaultRecord | None:
    """The slowest rank if it stayed above slowdown x the median for the whole window: even
    its fastest step of the last `window_steps` (`compute_min`) took longer than slowdown x
    the median rank's mean step. A windowed mean alone flags healthy ranks on a shared host:
    a burst of run-queue noise (2-3 slow steps out of 5) lifts one rank's mean past 1.5x, and
    it is replaced, then its replacement too (seen in tests/chaos; comparing its fastest step
    with the others' fastest also flagged one). A rank slowed by contention is slow on every
    step, by far more. On a GPU the figures are the device probe's (a fixed GEMM; the agent
    folds them into compute_avg and compute_min, worker/agent/rank_progress.py)."""
    full = [
        r
        for r in ranks
        if r.state == "running" and r.window_n >= window and r.compute_avg is not None
    ]
    if len(full) < 2 or len(full) < len(ranks):
        return None

    def fastest(r: RankStatus) -> float:
        return r.compute_min if r.compute_min is not None else r.compute_avg

    median = statistics.median(r.compute_avg for r in full)
    worst = max(full, key=fastest)
    if median <= 0 or fastest(worst) <= slowdown * median:
        return None
    return fault(
        "Straggler",
        worst,
        now,
        f"compute at least {fastest(worst) * 1e3:.0f} ms on each of the last {window} "
        f"steps (mean {worst.compute_avg * 1e3:.0f} ms) is "
        f"{fastest(worst) / median:.2f}x the median rank's mean {median * 1e3:.0f} ms "
        f"(bound {slowdown}x)",
    )
