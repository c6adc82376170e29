"""A trainer's metrics file, read by its agent as it grows, each line typed.

The trainer writes one `StepRecord` line after each optimizer step and one `{"event": ...}`
line per milestone or checkpoint event (docs/architecture.md, "Records"). The agent reads
the file while the trainer writes it, so the last line may be incomplete: it is kept until
its newline arrives. A line that does not parse is logged and skipped: one bad line must not
stop the agent relaying the rest.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from services.records import ExportReport, Record, StepRecord

log = logging.getLogger("meshkeeper.agent")


class Milestone(Record):
    """The trainer started, met its peers, or is ready to step. Times are the trainer's own
    wall clock (time.time())."""

    event: Literal["started", "rendezvous", "ready"]
    started_at: float | None = None
    rendezvous_at: float | None = None
    ready_at: float | None = None
    start_step: int | None = None  # (ready) steps completed before this generation's first
    # (started) the process takes its next generation in place (worker/trainer/handoff.py)
    restartable: bool | None = None


class Restored(Record):
    event: Literal["restored"]
    step: int  # the restored checkpoint's: steps completed
    restore_s: float
    source: str | None = None  # memory (own snapshot) | peer (buddy's copy) | disk
    via: str | None = None  # from memory: own | memory (a file on this host) | network
    replayed: int | None = None  # from memory: logged steps replayed after the whole snapshot


class SnapshotTaken(Record):
    """An in-memory snapshot finished (worker/trainer/snapshot.py): the rank's own copy, and
    the copies it received for its wards (rank -> step)."""

    event: Literal["snapshot"]
    step: int
    ok: bool = True  # False: this rank's own copy failed (error says why)
    kind: str | None = None  # whole | grads (a logged step; worker/snapshots.py)
    copied_bytes: int | None = None  # what the copy moved (a logged step's gradients reduced
    # into its slot are not copied: worker/trainer/snapshot_grads.py)
    held: dict[str, int] | None = None
    # ward -> how its copy came: "link" (its file on this host, under a second name),
    # "memory" (copied from that file, where no link could be made) or "network"
    held_via: dict[str, str] | None = None
    error: str | None = None
    blocking_s: float | None = None  # training time spent taking it and waiting for its copies


class CorruptionFound(Record):
    """A corruption check failed: the evidence every rank of the world reports before it exits
    with code 4 (RankReport.sdc)."""

    event: Literal["sdc"]
    # which check: None for the replicas' fingerprints (worker/trainer/sdc.py), "spot" for a
    # re-execution spot check, "at_rest" for a rank's own state check (at_rest.py)
    check: Literal["spot", "at_rest"] | None = None
    step: int  # the check that found it
    clean_step: int | None  # the newest checked step: what a recovery rolls back to
    tensor: str
    ranks: list[int]  # the replicas that disagreed
    suspects: list[int]  # the ranks the replay (or a majority) blames; empty: nobody could tell
    detail: str


class CheckpointCommitted(Record):
    event: Literal["checkpoint"]
    step: int
    path: str = ""
    keep: int = 1  # committed checkpoints the job keeps (the CAS drops older ones)
    blocking_s: float | None = None  # training time the save blocked
    total_s: float | None = None  # until committed


class CheckpointFailed(Record):
    event: Literal["checkpoint_failed"]
    step: int
    error: str = ""
    blocking_s: float | None = None  # training time the failed save blocked


class Exported(ExportReport):
    """checkpoint.export_hf was tried (rank 0, after the final commit)."""

    event: Literal["export"]


class OtherEvent(Record):
    """An event the agent relays nowhere (checkpoint_skipped, done)."""

    event: str


TrainerLine = (
    StepRecord
    | Milestone
    | Restored
    | SnapshotTaken
    | CorruptionFound
    | CheckpointCommitted
    | CheckpointFailed
    | Exported
    | OtherEvent
)
EVENTS: dict[str, type[Record]] = {
    "started": Milestone,
    "rendezvous": Milestone,
    "ready": Milestone,
    "restored": Restored,
    "snapshot": SnapshotTaken,
    "sdc": CorruptionFound,
    "checkpoint": CheckpointCommitted,
    "checkpoint_failed": CheckpointFailed,
    "export": Exported,
}


def parse_line(line: str) -> TrainerLine:
    """One line of a metrics file; ValueError when it is not a record (pydantic's
    ValidationError is one)."""
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object: {line[:80]!r}")
    event = data.get("event")
    model = StepRecord if event is None else EVENTS.get(event, OtherEvent)
    return model.model_validate(data)


class MetricsTail:
    """The complete lines appended to `path` since the last `read`."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self._offset = 0
        self._partial = ""

    def read(self) -> list[TrainerLine]:
        try:
            with self.path.open("r") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:  # the trainer has not opened it yet
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # "" after a complete line, else the line being written
        out: list[TrainerLine] = []
        for line in filter(None, lines):
            try:
                out.append(parse_line(line))
            except ValueError as e:
                log.warning(
                    "rank %d: unreadable metrics line %r: %s",
                    self.rank,
                    line[:200],
                    str(e).splitlines()[0],
                )
        return out
