"""What one reconcile pass of the lease holder knows, handed explicitly to everything it calls.

A `Pass` is built at the start of `Scheduler.run_once` and dropped at its end: the store and
its keys, the lease every write is fenced on, Redis server time as of its latest read, the
idle workers (`FreePool`), the live pool (read once, at first need), and the controller's
config and id.
A `JobView` is one running job as the pass sees it: its record, its current assignment and
the ranks' reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import redis

from controller.admission import PoolWorker, Quotas, live_pool
from controller.jobs import Job
from controller.placement import FreeWorker
from controller.priorities import PriorityClasses
from services.api import RankStatus
from services.assignment import Assignment
from services.store import Keys, Store, Tx


@dataclass(frozen=True)
class SchedulerConfig:
    worker_alive_s: float = 3.0  # a worker silent longer than this is not placed on
    rdzv_ports: tuple[int, int] = (20000, 32000)  # below Linux's ephemeral range
    # Backfill bound (docs/control-plane.md, "Scheduling"): a job that fits the pool but has
    # waited this long gets first claim on freed workers; later jobs stop backfilling past it.
    reserve_after_s: float = 300.0
    # A job whose handling raises in every pass for this long is failed, with the error as
    # its reason: skipped forever, it would hold its workers and show its owner a phase
    # that never changes (docs/security.md, "Poisoned state").
    fail_stuck_after_s: float = 10.0
    quotas: Quotas = Quotas()
    priorities: PriorityClasses = PriorityClasses()  # --priority-classes


class PoolUnreadable(RuntimeError):
    """The idle workers could not be read (a shared key of the wrong type, say). No job can be
    placed then, so the whole pass fails and is retried, and `/readyz` says so once that
    lasts, instead of each job being skipped, and failed, for it (controller/scheduler.py)."""


class FreePool:
    """The idle workers of one reconcile pass, read from Redis once (at first need). Whatever
    hands workers to a job in the pass (a pending job's start, a recovery, a grow-back) picks
    from `workers` and `take`s what it used, so no worker goes to two jobs in one pass.
    Workers released during the pass are not added: they are offered in the next one."""

    def __init__(self, read: Callable[[], list[FreeWorker]]):
        self._read = read
        self._workers: list[FreeWorker] | None = None

    @property
    def workers(self) -> list[FreeWorker]:
        if self._workers is None:
            try:
                self._workers = self._read()
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # an outage, not the state: the service's retry times it
            except Exception as e:
                raise PoolUnreadable(f"{type(e).__name__}: {e}") from e
        return list(self._workers)

    def take(self, wids: Iterable[str]) -> None:
        """Remove `wids` (those that are in the pool) for the rest of this pass."""
        gone = set(wids)
        self._workers = [w for w in self.workers if w.wid not in gone]


class WorkerActions(Protocol):
    """What the cluster around the pool does about a worker (Kubernetes: controller/pods.py).
    Called after the decision's transaction committed; must not block the pass."""

    def worker_left(self, wid: str, job_id: str, why: str) -> None:
        """A recovery moved blamed worker `wid` out of job `job_id` for `why`."""


@dataclass
class Pass:
    store: Store
    cfg: SchedulerConfig
    controller: str  # this replica's id, the `source` of its events
    lease: str  # every write of the pass is fenced on it
    # Redis server time: read at the start of the pass, and again with each running job's
    # beats (controller/following.py), so a long pass ages no job judged late in it
    now: float
    pool: FreePool
    actions: WorkerActions | None = None  # outside Redis: the cluster's pods (controller/pods.py)
    _live: list[PoolWorker] | None = field(default=None, repr=False)
    fits: dict[str, bool] = field(default_factory=dict, repr=False)  # controller/waiting.py

    @property
    def keys(self) -> Keys:
        return self.store.keys

    def live(self) -> list[PoolWorker]:
        """Every live registered worker, busy too (what a job could have were all idle)."""
        if self._live is None:
            self._live = live_pool(self.store, self.cfg.worker_alive_s)
        return self._live

    def commit(self, tx: Tx) -> None:
        self.store.commit(tx, self.lease)

    def event(self, kind: str, reason: str, message: str, generation: int) -> dict:
        """A job event as this controller writes it (`Tx.event`)."""
        return {
            "time": self.now,
            "type": kind,
            "reason": reason,
            "message": message,
            "generation": generation,
            "source": f"controller/{self.controller}",
        }


@dataclass
class JobView:
    """A running job in this pass: the record, its current assignment, its ranks."""

    job: Job
    asg: Assignment | None
    ranks: list[RankStatus]
