"""The job record in `job:{jid}` and the writes that create it.

Submission may happen on any controller replica (it creates a new key); every later write
goes through the lease holder's fenced transactions (controller/scheduler.py).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from controller.conditions import condition, phase_of, set_condition
from services.spec import JobSpec
from services.store import Store, loads

JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,78}[a-z0-9])?$")


@dataclass
class Job:
    id: str
    name: str
    spec: dict
    seq: int = 0
    generation: int = 0
    restarts: int = 0
    conditions: list[dict] = field(default_factory=list)
    cancel_requested: bool = False
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    final_ranks: list[dict] = field(default_factory=list)  # the rank view kept once terminal
    recoveries: list[dict] = field(default_factory=list)  # newest last, bounded
    current: dict = field(default_factory=dict)  # {dp, microbatches} when dp was shrunk
    flagged: dict = field(default_factory=dict)  # straggler reported (action: report)
    owner: str | None = None  # the submitting token's name (None: submitted before auth)

    @property
    def phase(self) -> str:
        return phase_of(self.conditions)

    @property
    def open_recovery(self) -> dict | None:
        r = self.recoveries[-1] if self.recoveries else None
        return r if r and r.get("completed_at") is None else None

    @property
    def target_dp(self) -> int:
        return int(self.spec["parallel"]["dp"])

    @property
    def dp(self) -> int:
        return int(self.current.get("dp", self.target_dp))

    @property
    def microbatches(self) -> int | None:
        return self.current.get("microbatches")

    @property
    def total_steps(self) -> int:
        return int(self.spec.get("train", {}).get("steps", 0))

    def absorb(self, progress: dict) -> None:
        """Take the latest step, loss and speed of a rank summary (`ranks.summarize`); the
        step never goes back (a report may be older than what was already stored)."""
        for k in ("step", "loss", "tokens_per_s", "step_s"):
            v = progress.get(k)
            if v is not None and (k != "step" or v >= self.step):
                setattr(self, k, v)

    def condition(self, type_: str) -> dict | None:
        return condition(self.conditions, type_)

    def set(self, type_: str, status: bool, reason: str, message: str, now: float) -> bool:
        return set_condition(self.conditions, type_, status, reason, message, now)

    def fields(self) -> dict[str, Any]:
        """The controller-owned fields, for HSET (the spec is written once, at submission)."""
        return {"phase": self.phase, "generation": self.generation, "restarts": self.restarts,
                "conditions": self.conditions, "started_at": self.started_at,
                "finished_at": self.finished_at, "step": self.step, "loss": self.loss,
                "tokens_per_s": self.tokens_per_s, "step_s": self.step_s,
                "final_ranks": self.final_ranks or None, "recoveries": self.recoveries or None,
                "current": self.current, "flagged": self.flagged}

    @classmethod
    def from_hash(cls, jid: str, h: dict[str, str]) -> "Job | None":
        if not h or "spec" not in h:
            return None

        def num(k: str, conv=float):
            return conv(h[k]) if h.get(k) not in (None, "") else None

        return cls(id=jid, name=h.get("name", jid), spec=loads(h["spec"], {}),
                   seq=num("seq", int) or 0, generation=num("generation", int) or 0,
                   restarts=num("restarts", int) or 0, conditions=loads(h.get("conditions"), []),
                   cancel_requested=h.get("cancel_requested") == "1",
                   submitted_at=num("submitted_at"), started_at=num("started_at"),
                   finished_at=num("finished_at"), step=num("step", int) or 0, loss=num("loss"),
                   tokens_per_s=num("tokens_per_s"), step_s=num("step_s"),
                   final_ranks=loads(h.get("final_ranks"), []),
                   recoveries=loads(h.get("recoveries"), []), current=loads(h.get("current"), {}),
                   flagged=loads(h.get("flagged"), {}), owner=h.get("owner") or None)


def new_job_id(name: str) -> str:
    """Kubernetes generateName style: the spec's name plus a random suffix."""
    return f"{name[:57]}-{secrets.token_hex(3)}"


def submit(store: Store, spec: JobSpec, owner: str) -> Job:
    """Store a validated spec (normalized: presets expanded, defaults filled) as a new job of
    `owner` (the submitting token's name; written once, like the spec)."""
    now = store.now()
    job = Job(id=new_job_id(spec.name), name=spec.name, spec=spec.model_dump(mode="json"),
              submitted_at=now, owner=owner)
    p = spec.parallel
    job.set("Admitted", True, "Validated",
            f"spec valid: {p.world_size} ranks (dp={p.dp} pp={p.pp} tp={p.tp}) "
            f"+ {spec.fault_tolerance.spares} spares", now)
    job.set("Running", False, "Queued", "waiting for the scheduler", now)
    store.create_job(job.id, {"id": job.id, "name": job.name, "spec": job.spec, "owner": owner,
                              "submitted_at": now, **job.fields()})
    store.add_event(job.id, {"type": "Normal", "reason": "Submitted",
                             "message": f"job {job.id} admitted", "source": "api"})
    return job
