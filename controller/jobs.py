"""The job record in `job:{jid}` and the writes that create it (docs/architecture.md,
"Redis keys").

Submission may happen on any controller replica (it creates a new key); every later write
goes through the lease holder's fenced transactions (controller/apply.py).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from controller.conditions import condition, phase_of, set_condition
from controller.goodput import Ledger
from controller.ranks import Progress
from services.api import RankStatus
from services.records import RecoveryRecord, StragglerFlag
from services.spec import JobSpec
from services.store import Store, loads

_RANKS = TypeAdapter(list[RankStatus])
_RECOVERIES = TypeAdapter(list[RecoveryRecord])
_CURRENT = TypeAdapter(dict[str, int | None])  # degrees, microbatches, grow_after
_DRAIN = TypeAdapter(dict[str, int | float])  # generation, step, at


def _json(models: list[BaseModel]) -> list[dict] | None:
    return [m.model_dump(mode="json") for m in models] or None


@dataclass
class Job:
    id: str
    name: str
    spec: JobSpec  # parsed once from the stored JSON (written once, at submission)
    seq: int = 0
    generation: int = 0
    restarts: int = 0
    conditions: list[dict] = field(default_factory=list)
    cancel_requested: bool = False
    suspend_requested: bool = False  # written by the API; the pass suspends or resumes
    preempted_by: str | None = None  # the job this one is stopping for (controller/preempting)
    # the step the current generation's ranks were told to stop after, and when (suspend)
    drain: dict = field(default_factory=dict)  # {generation, step, at}
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    step: int = 0  # steps completed; loss, tokens_per_s and step_s are of this step
    loss: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    epoch: int | None = None  # of this step's batch (finite data sources)
    eval_loss: float | None = None  # the latest validation, measured at eval_step
    eval_step: int | None = None
    final_ranks: list[RankStatus] = field(default_factory=list)  # the rank view once terminal
    recoveries: list[RecoveryRecord] = field(default_factory=list)  # newest last, bounded
    current: dict = field(default_factory=dict)  # {dp, microbatches} when dp was shrunk
    straggler: StragglerFlag | None = None  # reported, not replaced (action report, no spare)
    owner: str | None = None  # the submitting token's name (None: submitted before auth)
    goodput: Ledger | None = None  # the wall time since submission, split (controller/goodput)

    def __post_init__(self) -> None:
        if self.goodput is None:
            self.goodput = Ledger(at=self.submitted_at or 0.0)

    @property
    def phase(self) -> str:
        return phase_of(self.conditions)

    @property
    def open_recovery(self) -> RecoveryRecord | None:
        r = self.recoveries[-1] if self.recoveries else None
        return r if r and r.completed_at is None else None

    @property
    def awaiting_capacity(self) -> bool:
        """A recovery that stopped the world and waits for workers (the job queues again)."""
        rec = self.open_recovery
        return rec is not None and rec.action == "wait" and rec.to_generation is None

    @property
    def target_dp(self) -> int:
        return self.spec.parallel.dp

    # The current generation's degrees where a recovery changed them from the spec's (dp
    # shrunk, or re-planned: controller/replan.py); `current` is empty otherwise.
    @property
    def dp(self) -> int:
        return int(self.current.get("dp", self.target_dp))

    @property
    def pp(self) -> int:
        return int(self.current.get("pp", self.spec.parallel.pp))

    @property
    def tp(self) -> int:
        return int(self.current.get("tp", self.spec.parallel.tp))

    @property
    def ranks(self) -> int:
        """Ranks of the current layout (what quotas count)."""
        return self.dp * self.pp * self.tp

    @property
    def microbatches(self) -> int | None:
        return self.current.get("microbatches")

    @property
    def total_steps(self) -> int:
        return self.spec.train.steps

    def absorb(self, progress: Progress | None) -> None:
        """Take step, loss and speed together from one summary (`ranks.summarize`), only if
        it is not behind what is stored: a report may be older than what was already stored,
        and mixing fields of two reports showed one step with another step's loss."""
        # A report with no loss is of a rank that has not trained in its generation yet: its
        # step is the one it resumes at, whose loss only the old generation knew. Taken, it
        # was stored with the previous step's loss (a None is not written over it).
        if progress is None or progress.step < self.step or progress.loss is None:
            return
        self.step, self.loss = progress.step, progress.loss
        self.tokens_per_s, self.step_s = progress.tokens_per_s, progress.step_s
        # a generation reports no eval before its first one (nor an epoch before its first
        # step): the job's latest stands until then
        if progress.epoch is not None:
            self.epoch = progress.epoch
        if progress.eval_step is not None:
            self.eval_loss, self.eval_step = progress.eval_loss, progress.eval_step

    def condition(self, type_: str) -> dict | None:
        return condition(self.conditions, type_)

    def set(self, type_: str, status: bool, reason: str, message: str, now: float) -> bool:
        return set_condition(self.conditions, type_, status, reason, message, now)

    def fields(self) -> dict[str, Any]:
        """The controller-owned fields, for HSET (the spec is written once, at submission).
        None values are not written (`services.store.flat`)."""
        return {
            "phase": self.phase,
            "generation": self.generation,
            "restarts": self.restarts,
            "conditions": self.conditions,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "step": self.step,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "step_s": self.step_s,
            "epoch": self.epoch,
            "eval_loss": self.eval_loss,
            "eval_step": self.eval_step,
            "final_ranks": _json(self.final_ranks),
            "recoveries": _json(self.recoveries),
            "current": self.current,
            "drain": self.drain,
            "preempted_by": self.preempted_by or "",  # "" clears it (None is not written)
            "straggler": self.straggler.model_dump(mode="json") if self.straggler else None,
            "goodput": self.goodput.model_dump(mode="json"),
        }

    @classmethod
    def from_hash(cls, jid: str, h: dict[str, str]) -> Job | None:
        """None when the record is absent, half-written, or holds a spec or records this
        version cannot read."""
        if not h or "spec" not in h:
            return None

        def num(k: str, conv=float):
            return conv(h[k]) if h.get(k) not in (None, "") else None

        try:
            spec = JobSpec.model_validate(loads(h["spec"], {}))
            final_ranks = _RANKS.validate_python(loads(h.get("final_ranks"), []))
            recoveries = _RECOVERIES.validate_python(loads(h.get("recoveries"), []))
            flag = loads(h.get("straggler"))
            straggler = StragglerFlag.model_validate(flag) if flag else None
            ledger = loads(h.get("goodput"))
            goodput = Ledger.model_validate(ledger) if ledger else None
            current = _CURRENT.validate_python(loads(h.get("current"), {}))
            drain = _DRAIN.validate_python(loads(h.get("drain"), {}))
        except ValidationError:
            return None
        return cls(
            id=jid,
            name=h.get("name", jid),
            spec=spec,
            seq=num("seq", int) or 0,
            generation=num("generation", int) or 0,
            restarts=num("restarts", int) or 0,
            conditions=loads(h.get("conditions"), []),
            cancel_requested=h.get("cancel_requested") == "1",
            suspend_requested=h.get("suspend_requested") == "1",
            drain=drain,
            preempted_by=h.get("preempted_by") or None,
            submitted_at=num("submitted_at"),
            started_at=num("started_at"),
            finished_at=num("finished_at"),
            step=num("step", int) or 0,
            loss=num("loss"),
            tokens_per_s=num("tokens_per_s"),
            step_s=num("step_s"),
            epoch=num("epoch", int),
            eval_loss=num("eval_loss"),
            eval_step=num("eval_step", int),
            final_ranks=final_ranks,
            recoveries=recoveries,
            current=current,
            straggler=straggler,
            owner=h.get("owner") or None,
            goodput=goodput,
        )


def new_job_id(name: str) -> str:
    """Kubernetes generateName style: the spec's name plus a random suffix."""
    return f"{name[:57]}-{secrets.token_hex(3)}"


def waiting_of(store: Store, owner: str) -> int:
    """How many of `owner`'s jobs wait to start (phase Pending, not cancelled): one round trip
    over the open jobs, which the per-owner cap keeps few."""
    jids = store.job_ids(open_only=True)
    pipe = store.r.pipeline(transaction=False)
    for jid in jids:
        pipe.hmget(store.keys.job(jid), "owner", "phase", "cancel_requested")
    return sum(
        1
        for who, phase, cancel in pipe.execute()
        if who == owner and phase == "Pending" and not cancel
    )


IDEMPOTENCY_KEY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def submit(
    store: Store, spec: JobSpec, owner: str, idempotency_key: str | None = None, ttl_s: float = 0
) -> tuple[str, bool]:
    """Store a validated spec (normalized: presets expanded, defaults filled) as a new job of
    `owner` (the submitting token's name; written once, like the spec). Returns the job id and
    whether it is new.

    With an `idempotency_key` (the API's Idempotency-Key header), the first submission of
    `owner` under that key creates the job and every later one returns the same id for `ttl_s`
    (the job retention): a client that lost the answer, or the operator restarted before it
    wrote status.jobID, submits again without making a second job. The key is claimed with
    SET NX before the job is written, so two racing submissions make one job."""
    jid = new_job_id(spec.name)
    if idempotency_key is not None:
        key = store.keys.idempotency(owner, idempotency_key)
        if not store.r.set(key, jid, nx=True, ex=max(1, int(ttl_s))):
            return store.r.get(key) or jid, False
    now = store.now()
    job = Job(id=jid, name=spec.name, spec=spec, submitted_at=now, owner=owner)
    p = spec.parallel
    job.set(
        "Admitted",
        True,
        "Validated",
        f"spec valid: {p.world_size} ranks (dp={p.dp} pp={p.pp} tp={p.tp}) "
        f"+ {spec.fault_tolerance.spares} spares",
        now,
    )
    job.set("Running", False, "Queued", "waiting for the scheduler", now)
    store.create_job(
        job.id,
        {
            "id": job.id,
            "name": job.name,
            "owner": owner,
            "spec": spec.model_dump(mode="json"),
            "submitted_at": now,
            # submitted suspended (Kueue's contract): the pass suspends it before placing it
            "suspend_requested": "1" if spec.suspend else "0",
            **job.fields(),
        },
    )
    store.add_event(
        job.id,
        {
            "type": "Normal",
            "reason": "Submitted",
            "message": f"job {job.id} admitted",
            "source": "api",
        },
    )
    return job.id, True
