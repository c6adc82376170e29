"""What fault handling decides for a running job (controller/faults.py) and the scheduler
writes (controller/apply.py). Each decision is data: deciding reads, never writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.quarantine import Blame
from controller.recovery import Layout
from services.records import RecoveryRecord, StragglerFlag


@dataclass(frozen=True)
class Finish:
    """End the job: `outcome` Succeeded or Failed, every worker released."""

    outcome: str
    reason: str
    message: str
    restart: bool = False  # the fault counted as a restart (it reached max_restarts)
    blame: Blame = field(default_factory=Blame)


@dataclass(frozen=True)
class Recover:
    """A new generation on `layout` (replace, shrink or restart) after a fault; `record`
    is the recovery, not yet numbered with its generation."""

    layout: Layout
    record: RecoveryRecord
    reason: str  # ReplacingRank | ShrinkingDP | Restarting
    message: str
    blame: Blame = field(default_factory=Blame)


@dataclass(frozen=True)
class WaitForCapacity:
    """Stop the generation and queue again: no spare, and dp already at min_dp."""

    record: RecoveryRecord
    message: str
    blame: Blame = field(default_factory=Blame)


@dataclass(frozen=True)
class Grow:
    """Back towards the submitted layout on returning capacity (planned: not a restart)."""

    layout: Layout
    record: RecoveryRecord
    message: str
    reason: str = "GrowingDP"  # RestoringLayout: back from a re-plan's pp or tp


@dataclass(frozen=True)
class SetGrowAfter:
    """Capacity for a grow appeared (grow after the checkpoint after `step`), or went away
    (None)."""

    step: int | None


@dataclass(frozen=True)
class FlagStraggler:
    """Report a straggler that is not replaced (action report, or no candidate)."""

    flag: StragglerFlag
    message: str


@dataclass(frozen=True)
class Complete:
    """The open recovery is done: every rank of its generation trained a step."""

    record: RecoveryRecord  # the open record with completed_at, resumed_step and durations
    message: str


Decision = Finish | Recover | WaitForCapacity | Grow | SetGrowAfter | FlagStraggler | Complete
