"""REST API documents: the controller serves them (and its OpenAPI schema shows them), the
client parses them. Unknown fields are kept, so an older client reads a newer controller."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.records import (
    ExportReport,
    HistoryPoint,
    RankReport,
    RecoveryRecord,
    StragglerFlag,
)


class Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class Problem(Doc):
    field: str
    message: str


class Error(Doc):
    detail: str
    problems: list[Problem] = []


class Condition(Doc):
    type: str
    status: str  # "True" | "False"
    reason: str
    message: str
    lastTransitionTime: float


class Coordinate(Doc):
    dp: int
    pp: int
    tp: int
    # experts split over ep (parallel.ep > 1): in a mesh shape the degree, in a rank's
    # coordinate the expert shard it holds (dp % ep); left out of a job without
    ep: int | None = Field(default=None, exclude_if=lambda v: v is None)


class RankStatus(RankReport):
    """A rank's place in the mesh and its agent's latest report of it. Frozen: the controller
    shares one per distinct report between passes and requests (controller/ranks.py)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    rank: int
    coord: Coordinate
    worker: str
    local_rank: int


class Mesh(Doc):
    shape: Coordinate
    generation: int | None = None
    rendezvous: str | None = None
    ranks: list[RankStatus] = []
    spares: list[str] = []
    dp_labels: list[int] = Field(
        default=[],
        description="each replica's dp index in the submitted layout, by its dp coordinate "
        "now: after a shrink the kept replicas are renumbered from 0, their labels are not",
    )


class Checkpoint(Doc):
    step: int
    path: str | None = None
    time: float
    generation: int


Recovery = RecoveryRecord  # one spelling (services/records.py); the API name stays


class JobSummary(Doc):
    id: str
    name: str
    phase: str
    generation: int
    restarts: int
    step: int
    steps: int
    loss: float | None = None
    mesh_shape: Coordinate = Field(
        description="the mesh the job runs now (smaller than the spec's after a shrink or a "
        "re-plan, until it grows back)"
    )
    target_shape: Coordinate | None = Field(
        default=None, description="the spec's mesh, when the job runs another one now"
    )
    submitted_at: float | None = None
    finished_at: float | None = None
    owner: str | None = None  # the name of the token that submitted it


class GoodputParts(Doc):
    """Where the wall time since admission went: no second in two parts, none in none."""

    productive_s: float = Field(
        description="training that counts: the time a world trained, less the parts below "
        "that happened while it did (redone, checkpoint, snapshot, eval)"
    )
    redone_s: float = Field(
        description="training steps the job had done before: a world behind the furthest step "
        "the job reached, after a recovery or a stop that lost steps"
    )
    recovery_s: float = Field(
        description="each recovery from its fault to its new world's first step (the records' "
        "durations.total_s), waiting for workers after a fault included"
    )
    checkpoint_s: float = Field(description="training held by checkpoint saves (rank 0's)")
    snapshot_s: float = Field(description="training held by in-memory snapshots (rank 0's)")
    eval_s: float = Field(description="validation (eval.every_steps), rank 0's")
    waiting_s: float = Field(
        description="queued for capacity or quota, and a placement's start until its first "
        "step, unless it follows a suspend or a preemption"
    )
    suspended_s: float = Field(
        description="suspended, or preempted and queued again, until the next world's first step"
    )


class RecoveryPhases(Doc):
    """`recovery_s` by phase, from each recovery's record (docs/fault-tolerance.md)."""

    detect_s: float = Field(description="from the fault until the controller saw it")
    decide_s: float = Field(
        description="until the new world was written (for a recovery that waited for workers, "
        "until they came)"
    )
    rendezvous_s: float = Field(description="until every rank met its peers")
    restore_s: float = Field(description="until every rank restored its state")
    first_step_s: float = Field(description="until every rank finished its first step")


class Goodput(Doc):
    """The job's goodput ledger (docs/architecture.md, "The goodput ledger"): its wall time
    since admission, split into parts that add up to it."""

    wall_s: float = Field(description="since admission (submitted_at), until now or the end")
    ettr: float | None = Field(
        description="effective training time ratio: productive_s / (wall_s - suspended_s); "
        "None before any time that was not suspended"
    )
    parts: GoodputParts
    recovery_phases: RecoveryPhases


class JobStatus(JobSummary):
    conditions: list[Condition]
    tokens_per_s: float | None = None
    step_s: float | None = None
    epoch: int | None = None  # 0-based pass over a finite data source
    # the latest validation (eval.every_steps): mean held-out loss, exp of it, and the step
    # (steps completed) it was measured after
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    eval_step: int | None = None
    eta_s: float | None = None
    started_at: float | None = None
    last_checkpoint: Checkpoint | None = None
    # checkpoint.export_hf: the final checkpoint as a Hugging Face directory, or why not
    export: ExportReport | None = None
    # asked to suspend (POST .../suspend) and not resumed since: while Running it is stopping
    suspend_requested: bool = False
    mesh: Mesh
    recoveries: list[RecoveryRecord] = []
    straggler: StragglerFlag | None = None  # reported, not replaced, in this generation
    goodput: Goodput | None = None
    spec: dict[str, Any]

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


class CheckpointMark(Doc):
    step: int
    time: float | None = None
    generation: int | None = None


class JobHistory(Doc):
    """A job's whole training history, downsampled to at most `max_points` points, with the
    recoveries and checkpoint commits to mark on it (`GET /v1/jobs/{id}/history`)."""

    id: str
    points: list[HistoryPoint]
    total_points: int  # points stored before downsampling
    recoveries: list[RecoveryRecord] = []
    checkpoints: list[CheckpointMark] = []


class JobList(Doc):
    jobs: list[JobSummary]


class Submitted(Doc):
    id: str
    phase: str


class CancelAccepted(Doc):
    id: str
    phase: str
    cancel_requested: bool


class SuspendAccepted(Doc):
    id: str
    phase: str
    suspend_requested: bool


class Event(Doc):
    id: str
    time: float
    type: str
    reason: str
    message: str
    source: str | None = None
    generation: int | None = None


class EventList(Doc):
    events: list[Event]


class LogLine(Doc):
    id: str = Field(description="its stream id: pass it as `after` to read on from there")
    rank: int
    generation: int
    line: str


class LogList(Doc):
    lines: list[LogLine]


class Worker(Doc):
    id: str
    host: str | None = None
    address: str | None = None
    labels: dict[str, str] = {}
    devices: int = 1
    state: str
    alive: bool
    last_seen_s: float
    job: str | None = None
    generation: int | None = None
    role: str | None = None


class WorkerList(Doc):
    workers: list[Worker]


class PlanRequest(BaseModel):
    """`POST /v1/plan`: a job spec and the cluster to plan it for; without `workers`, the live
    pool (docs/planner.md)."""

    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] = Field(description="a job spec, as POST /v1/jobs takes it")
    workers: int | None = Field(
        default=None, ge=1, le=65536, description="hosts; omit to plan for the live pool"
    )
    devices_per_worker: int | None = Field(default=None, ge=1, le=1024)
    device: str | None = Field(
        default=None,
        max_length=32,
        description="hardware profile: cpu, a100-80gb, h100-80gb, h200-141gb",
    )
    memory_per_device_bytes: int | None = Field(
        default=None, ge=1, description="overrides the profile's (needed for cpu)"
    )
    fabric: str | None = Field(
        default=None,
        max_length=32,
        description="the network between hosts: infiniband (the profile's own cross-host "
        "figures) or tcp (NCCL over sockets on a 100 Gb/s Ethernet NIC per host, no RDMA); "
        "omit for the live pool's (tcp if any worker joined over tcp) or, with `workers`, "
        "infiniband",
    )


class PlanDoc(Doc):
    """One layout, costed: per-rank memory, step time and its parts, and why."""

    dp: int
    pp: int
    tp: int
    zero: int
    microbatches: int
    virtual_stages: int
    pp_schedule: str
    activation_checkpointing: bool | str
    memory_per_rank_bytes: int
    snapshot_per_rank_bytes: int = Field(
        default=0,
        description="host memory the rank's in-memory snapshot rings take at the peak "
        '(docs/planner.md, "Snapshot rings"); 0 without snapshots',
    )
    step_time_s: float
    bubble: float
    feasible: bool
    explanation: str
    problems: list[str] = []
    memory: dict[str, int] = {}
    time: dict[str, float] = {}
    comm_bytes: dict[str, int] = {}


class PlanResult(Doc):
    """`fabric`: the network assumed between hosts; `given`: the spec's own layout (null under
    parallel.auto); `plans`: every feasible layout, best first."""

    # a controller that predates fabrics always assumed infiniband
    fabric: str = Field(default="infiniband", description="the network assumed between hosts")
    given: PlanDoc | None
    plans: list[PlanDoc]
