"""REST API documents: the controller serves them (and its OpenAPI schema shows them), the
client parses them. Unknown fields are kept, so an older client reads a newer controller."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


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


class RankStatus(Doc):
    rank: int
    coord: Coordinate
    worker: str
    local_rank: int
    state: str
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    wait_s: float | None = None
    pid: int | None = None  # the trainer process on its worker's host
    exit_code: int | None = None
    error: str | None = None  # why a rank failed, when no exit code tells
    log: str | None = None


class Mesh(Doc):
    shape: Coordinate
    generation: int | None = None
    rendezvous: str | None = None
    ranks: list[RankStatus] = []
    spares: list[str] = []


class Checkpoint(Doc):
    step: int
    path: str | None = None
    time: float
    generation: int


class Recovery(Doc):
    """One recovery: why, what was done, and how long each phase took (controller/faults.py)."""

    n: int
    cause: str  # TrainerKilled | WorkerDead | RankHung | Straggler | TrainerFailed | CapacityReturned
    action: str | None = None  # replace | shrink | restart | wait | grow
    faults: list[dict[str, Any]] = []
    replaced: list[dict[str, str]] = []  # {old, new} workers
    from_generation: int
    to_generation: int | None = None
    to_shape: list[int] | None = None
    fault_at: float
    detected_at: float
    decided_at: float | None = None
    completed_at: float | None = None
    last_step: int = 0
    resumed_step: int | None = None
    steps_lost: int | None = None
    durations: dict[str, float] | None = None


class JobSummary(Doc):
    id: str
    name: str
    phase: str
    generation: int
    restarts: int
    step: int
    steps: int
    loss: float | None = None
    mesh_shape: Coordinate
    submitted_at: float | None = None
    finished_at: float | None = None
    owner: str | None = None  # the name of the token that submitted it


class JobStatus(JobSummary):
    conditions: list[Condition]
    tokens_per_s: float | None = None
    step_s: float | None = None
    eta_s: float | None = None
    started_at: float | None = None
    last_checkpoint: Checkpoint | None = None
    mesh: Mesh
    recoveries: list[Recovery] = []
    spec: dict[str, Any]

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


class JobList(Doc):
    jobs: list[JobSummary]


class Submitted(Doc):
    id: str
    phase: str


class CancelAccepted(Doc):
    id: str
    phase: str
    cancel_requested: bool


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
