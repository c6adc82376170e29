"""The records that cross a process boundary, each spelled once (docs/architecture.md, "Records").

A trainer writes `StepRecord` lines to its metrics file; its agent folds them into one
`RankReport` per rank and publishes the reports in `worker:{wid}:progress`; the controller
reads them back as `RankReport`, joins them with the assignment (`api.RankStatus` is a
`RankReport` plus the rank's place in the mesh) and keeps `RecoveryRecord`s and
`HistoryPoint`s on the job. One model per record, validated where it is read, so a field
renamed on one side fails a test instead of reading as None on the other.

Step numbering, everywhere: `step` is the number of optimizer steps completed. The trainer
that has just run step index i (0-based) reports step i + 1; a checkpoint taken after it is
checkpoint `step` i + 1 and a restore from it runs index i + 1 next.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict

# A trainer's exit status after it stopped on request at a step boundary and committed that
# step (suspend; worker/trainer/drain.py): the job resumes from it, so it is not a failure.
EXIT_SUSPENDED = 6
# A trainer's exit status after its device failed (a CUDA error; worker/trainer/device_fault.py):
# the controller blames, replaces and quarantines its worker (controller/health.py).
EXIT_DEVICE = 7


class Record(BaseModel):
    # extra="ignore": a newer writer may add fields; an older reader must still parse it.
    model_config = ConfigDict(extra="ignore")


class ExpertLoad(Record):
    """One step's routing over the global batch, summed over every MoE layer (model.experts >
    0; rank 0's step records carry it)."""

    tokens: list[int]  # (token, choice) pairs each expert computed
    dropped: int  # choices over an expert's capacity (0 when routing is dropless)
    balance_loss: float  # Switch's balance loss, mean over layers and sequences; 1.0 is uniform

    @property
    def drop_rate(self) -> float:
        routed = sum(self.tokens) + self.dropped
        return self.dropped / routed if routed else 0.0


class StepRecord(Record):
    """One line a trainer writes to its metrics file after each optimizer step."""

    step: int  # steps completed (see the module docstring)
    loss: float
    tokens_per_s: float
    step_s: float
    compute_s: float  # this rank's own work, excluding time blocked in collectives
    wait_s: float  # time blocked in collectives (pipeline bubbles, all-reduces)
    # a GPU rank's device probe: a fixed GEMM's time, no communication in it; the straggler
    # signal where it is present (worker/trainer/device_probe.py)
    probe_s: float | None = None
    lr: float
    grad_norm: float | None = None
    # bytes, the process's peak so far: max RSS on CPU, max_memory_allocated on GPU
    peak_mem_bytes: int | None = None
    rank: int
    time: float  # the trainer's wall clock (time.time()) when the step ended
    experts: ExpertLoad | None = None
    epoch: int | None = None  # 0-based pass over a finite source the step's batch came from
    # validation (eval.every_steps): mean loss over the held-out batches, after this step's
    # update; eval_s is its wall time, counted in neither step_s nor tokens_per_s
    eval_loss: float | None = None
    eval_s: float | None = None


def perplexity(loss: float) -> float | None:
    """exp(loss), the perplexity of a mean token cross-entropy; None where it overflows a
    float (a diverged model's), which JSON could not carry."""
    try:
        return math.exp(loss)
    except OverflowError:
        return None


class ExportReport(Record):
    """The job's final checkpoint as a Hugging Face directory (`checkpoint.export_hf`)."""

    path: str
    step: int
    bytes: int | None = None  # of the weights written; None when it failed
    error: str | None = None  # why it was not written


class Overheads(Record):
    """What a rank's training thread spent in its generation, since its first step, outside
    the steps: blocked on checkpoint saves (each save's `blocking_s`), blocked on in-memory
    snapshots (each snapshot's `blocking_s`), and evaluating (each step's `eval_s`). Totals
    only grow within a generation; the controller's goodput ledger takes rank 0's
    (controller/goodput.py). What came before the first step lies in the start or the
    recovery the controller times up to that step, so it is not counted here."""

    checkpoint_s: float = 0.0
    snapshot_s: float = 0.0
    eval_s: float = 0.0


class RankReport(Record):
    """What an agent publishes for one rank it runs (the `ranks` field of
    `worker:{wid}:progress`, a JSON object keyed by rank). Times are Redis server time."""

    state: str = "assigned"  # services/assignment.py RANK_STATES
    step: int = 0  # steps completed
    loss: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    wait_s: float | None = None
    peak_mem_bytes: int | None = None  # the latest StepRecord's
    epoch: int | None = None  # the latest StepRecord's (finite data sources)
    # the latest validation this generation (rank 0's: the rank that reports it), at eval_step
    eval_loss: float | None = None
    eval_step: int | None = None
    eval_s: float | None = None
    pid: int | None = None  # the trainer process on its worker's host
    exit_code: int | None = None
    error: str | None = None  # why a rank failed, when no exit code tells
    log: str | None = None
    # milestones of this generation (fault handling times the recovery phases from them)
    started_at: float | None = None
    rendezvous_at: float | None = None
    ready_at: float | None = None
    start_step: int | None = None  # the step it resumed at
    first_step_at: float | None = None
    restored_from: str | None = None  # memory | peer | disk; None: nothing restored
    exited_at: float | None = None
    progress_at: float | None = None  # last time anything was heard from the trainer
    # blame evidence (controller/health.py)
    # the straggler signal over its window: each step's probe_s where the rank has a device
    # probe (a GPU), else its compute_s
    compute_avg: float | None = None
    compute_min: float | None = None
    window_n: int = 0
    proc_state: str | None = None  # R, S, D, T... from the process table
    coll_entered: int | None = None  # collective-phase counters (worker/progress.py)
    coll_left: int | None = None
    cpu_busy: bool | None = None
    peak_rss: int | None = None  # bytes
    oom: dict[str, Any] | None = None  # set when the exit was an OOM kill
    # what NVML said about the rank's GPU after a device error (EXIT_DEVICE): its uuid, the
    # critical Xid events while the trainer ran, the uncorrectable ECC errors counted meanwhile,
    # row remapping pending or failed, or that the GPU is lost (worker/agent/device_health.py)
    device: dict[str, Any] | None = None
    # the flight recorder's dump of a rank the NCCL watchdog aborted, per process group (its
    # name): the last collective that completed, the first that did not with its state
    # (scheduled: queued by the host; started: its kernel ran), worker/flight_record.py
    flight: dict[str, Any] | None = None
    # hot recovery (docs/architecture.md, "Hot recovery"): the step of the rank's newest
    # complete snapshot, and of the newest complete copy it holds for its ward (with several
    # wards, the oldest of their newest copies: every ward has at least that step)
    snapshot_step: int | None = None
    held_step: int | None = None
    # silent data corruption (docs/architecture.md, "Silent data corruption"): the trainer's
    # evidence, the same dict from every rank of the job, which then exits with code 4:
    # step (the check that found it), clean_step (the newest checked step: the rollback
    # target), tensor (the first mismatching tensor), ranks (whose fingerprints disagreed),
    # suspects (ranks blamed by re-execution; empty: it could not tell), detail (a sentence)
    sdc: dict[str, Any] | None = None
    # checkpoint.export_hf, once the trainer tried it (rank 0): the directory, the step, and
    # its size, or why it failed (`ExportReport`)
    export: ExportReport | None = None
    overheads: Overheads = Overheads()  # this generation's totals so far


class FaultRecord(Record):
    """One faulty rank, as fault handling saw it."""

    # TrainerKilled | WorkerDead | RankHung | Straggler | TrainerFailed | RepeatedFailures |
    # JobStalled | SilentDataCorruption | SilentDataCorruptionUnattributed
    cause: str
    rank: int
    worker: str
    coord: dict[str, int]
    fault_at: float
    detail: str
    evidence: dict[str, Any] | None = None  # what proved it, where a report carries it (sdc)


class Quarantine(Record):
    worker: str
    until: float
    cause: str


class RecoveryRecord(Record):
    """One recovery: why, what was done, and how long each phase took."""

    n: int
    cause: str  # a FaultRecord cause, or CapacityReturned for a planned grow
    action: str | None = None  # replace | shrink | restart | wait | grow
    faults: list[FaultRecord] = []
    replaced: list[dict[str, str]] = []  # {old, new} workers
    quarantined: list[Quarantine] = []
    from_generation: int
    # the layout the fault struck: [dp, pp, tp], and each replica's submitted dp index
    # (the page draws it, the faulted ranks red, until the new generation trains)
    from_shape: list[int] | None = None
    from_dp_labels: list[int] | None = None
    to_generation: int | None = None
    to_shape: list[int] | None = None  # [dp, pp, tp]
    fault_at: float
    detected_at: float
    decided_at: float | None = None
    completed_at: float | None = None
    # the furthest step any rank had completed when the fault was seen (the job's step where
    # the reports are gone with their worker)
    last_step: int = 0
    resumed_step: int | None = None  # the step the new generation resumed from; None: unsaid
    steps_lost: int | None = None  # redone: last_step - resumed_step; None with resumed_step
    # detect_s, decide_s, rendezvous_s, restore_s, first_step_s, total_s
    durations: dict[str, float] | None = None
    restored_from: dict[str, str] | None = None  # rank -> memory | peer | disk

    def redone_summary(self) -> str:
        """'resumed at step 15, 5 steps redone'; a resume no rank reported is said so, never
        printed as step 0."""
        if self.resumed_step is None:
            return "resumed at a step no rank reported"
        return f"resumed at step {self.resumed_step}, {self.steps_lost} steps redone"

    def restored_summary(self) -> str:
        """How many ranks restored from where, most first: 'memory 3, peer 1'."""
        counts = Counter((self.restored_from or {}).values())
        return ", ".join(f"{source} {n}" for source, n in counts.most_common())


class StragglerFlag(Record):
    """A straggler reported rather than replaced (action: report, or no spare), once per
    rank and generation."""

    rank: int
    worker: str
    generation: int


class HistoryPoint(Record):
    """One point of a job's training history (the page's charts, `GET .../history`)."""

    step: int
    time: float
    loss: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    generation: int
    # the job's latest validation when the point was taken, measured at eval_step (<= about
    # step): a pass may skip the very step of an eval, and downsampling may hide its point,
    # so every point carries the newest eval and readers key the eval series by eval_step
    eval_loss: float | None = None
    eval_step: int | None = None
