"""What one rank's trainer has reported in its generation, folded into its `RankReport` fields.

Pure bookkeeping (no process, no file): the agent feeds it the trainer's typed metrics lines
(worker/agent/metrics_tail.py). Times are Redis server time: the trainer's own clock plus the
heartbeat's clock offset, so the controller can compare them with its own.

`step` is steps completed (docs/architecture.md, "Records"): the latest step record's. Before
the generation's first step it is the step the rank resumes at, as soon as the trainer has
said (its `restored` event, then `ready`'s start_step), else 0: a restarted rank does not
report going back to 0 while it restores.

A validation runs every `eval.every_steps` steps only: its loss (with the step it was measured
at) stays in the report until the next one, so a report between two evals still shows it.

`overheads` totals the time the training thread spent outside steps since the generation's
first step (services/records.py, `Overheads`): the first step's own eval ends before its line
is written, which is the rank's first_step_at, and the snapshot of the state it started from
is waited for within that first step; both lie in the start the controller times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.records import ExportReport, Overheads, StepRecord
from worker.agent.metrics_tail import (
    CheckpointCommitted,
    CheckpointFailed,
    CorruptionFound,
    Exported,
    Milestone,
    Restored,
    SnapshotTaken,
    TrainerLine,
)


@dataclass
class RankProgress:
    started_at: float  # the agent's launch time, until the trainer's own `started` replaces it
    window: int = 20  # steps in the straggler window (the spec's straggler.window_steps)
    state: str = "starting"  # running from the first step on; the agent sets the final state
    last: StepRecord | None = None  # the latest step record
    last_eval: StepRecord | None = None  # the latest step record with a validation loss
    rendezvous_at: float | None = None
    ready_at: float | None = None
    start_step: int | None = None
    first_step_at: float | None = None
    progress_at: float = 0.0  # last time the trainer wrote anything
    restartable: bool = False  # its process takes the next generation in place (handoff.py)
    restored_from: str | None = None  # memory | peer | disk
    snapshot_step: int | None = None  # newest complete own in-memory snapshot
    held_step: int | None = None  # newest step of which every ward's copy arrived here
    snapshot_error: str | None = None  # the latest snapshot failure
    sdc: dict[str, Any] | None = None  # silent data corruption found (RankReport.sdc)
    export: ExportReport | None = None  # checkpoint.export_hf's outcome (RankReport.export)
    overheads: Overheads = field(default_factory=Overheads)  # since the first step
    # the straggler signal over the window: probe_s on a GPU (its step clock counts waits on
    # NCCL as compute; worker/trainer/device_probe.py), else compute_s
    computes: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.progress_at = self.progress_at or self.started_at

    def absorb(self, line: TrainerLine, now: float, offset: float) -> None:
        """Take one line of the trainer's metrics file; `now` is server time, `offset` is
        server time minus the trainer's (local) clock."""
        self.progress_at = now
        if isinstance(line, Milestone):
            for key in ("started_at", "rendezvous_at", "ready_at"):
                if (t := getattr(line, key)) is not None:
                    setattr(self, key, t + offset)
            if line.start_step is not None:
                self.start_step = line.start_step
            if line.restartable is not None:
                self.restartable = line.restartable
        elif isinstance(line, Restored):
            self.start_step, self.restored_from = line.step, line.source
        elif isinstance(line, SnapshotTaken):
            if line.ok:
                self.snapshot_step = line.step
            if line.held:
                self.held_step = min(line.held.values())
            self.snapshot_error = line.error
            if line.blocking_s and line.step > (self.start_step or 0):  # not the start state's
                self.overheads.snapshot_s += line.blocking_s
        elif isinstance(line, (CheckpointCommitted, CheckpointFailed)):
            self.overheads.checkpoint_s += line.blocking_s or 0.0
        elif isinstance(line, CorruptionFound):
            self.sdc = line.model_dump(exclude={"event"})
        elif isinstance(line, Exported):
            self.export = ExportReport.model_validate(line.model_dump(exclude={"event"}))
        elif isinstance(line, StepRecord):
            if self.last is not None and line.eval_s:  # not the first step's: see above
                self.overheads.eval_s += line.eval_s
            self.last, self.state = line, "running"
            if line.eval_loss is not None:
                self.last_eval = line
            if self.first_step_at is None:
                self.first_step_at = line.time + offset
            self.computes.append(line.probe_s if line.probe_s is not None else line.compute_s)
            while len(self.computes) > self.window:
                self.computes.popleft()

    @property
    def step(self) -> int:
        if self.last is not None:
            return self.last.step
        return self.start_step or 0

    def fields(self) -> dict[str, Any]:
        """The `RankReport` fields this knows (the process's own are the caller's)."""
        last, evaluated, computes = self.last, self.last_eval, self.computes
        return {
            "state": self.state,
            "step": self.step,
            "loss": last.loss if last else None,
            "tokens_per_s": last.tokens_per_s if last else None,
            "step_s": last.step_s if last else None,
            "compute_s": last.compute_s if last else None,
            "wait_s": last.wait_s if last else None,
            "peak_mem_bytes": last.peak_mem_bytes if last else None,
            "epoch": last.epoch if last else None,
            "eval_loss": evaluated.eval_loss if evaluated else None,
            "eval_step": evaluated.step if evaluated else None,
            "eval_s": evaluated.eval_s if evaluated else None,
            "started_at": self.started_at,
            "rendezvous_at": self.rendezvous_at,
            "ready_at": self.ready_at,
            "start_step": self.start_step,
            "first_step_at": self.first_step_at,
            "progress_at": self.progress_at,
            "compute_avg": sum(computes) / len(computes) if computes else None,
            "compute_min": min(computes) if computes else None,
            "window_n": len(computes),
            "restored_from": self.restored_from,
            "snapshot_step": self.snapshot_step,
            "held_step": self.held_step,
            "sdc": self.sdc,
            "export": self.export,
            "overheads": self.overheads.model_dump(),
        }
