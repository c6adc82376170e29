"""Bounded state (docs/architecture.md, "Redis keys"): what the controller stores stays
proportional to what is live, not to everything that ever ran.

- A job that ended more than `job_retention_s` ago is archived, as one JSON line in
  `{archive_dir}/jobs.jsonl` (its record, assignment, checkpoint pointer, events and a history
  downsampled to ARCHIVED_POINTS), then every key of it is deleted in one fenced transaction.
  Without an archive directory it is only deleted. The archive line is written (and fsynced)
  before the delete, so a crash between the two leaves the job in Redis and archives it again
  on the next pass: readers take the last line of an id.
- A worker silent (or deregistered) for `worker_retention_s` is forgotten: its keys, its
  place in `workers:seen` and its Redis ACL user. Series keyed by worker id disappear with it,
  since the metrics read `workers:seen`. A worker a job's assignment still names is left to the
  job's own fault handling, which releases it first.

Each pass handles at most `batch` of each, oldest first, from the two time-ordered indexes
(`jobs:finished`, `workers:seen`/`workers:gone`): its cost follows what expired, never the
whole store.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from controller import history
from controller.jobs import Job
from services.store import Store, Tx, agent_user

log = logging.getLogger("meshkeeper.retention")

ARCHIVED_POINTS = 1000  # history points kept in a job's archive line (downsampled)


@dataclass(frozen=True)
class RetentionConfig:
    job_retention_s: float = 7 * 86400
    """How long a finished job stays in Redis (status, events, history) before it is archived
    and deleted."""
    worker_retention_s: float = 3600.0
    """How long a silent or deregistered worker's records stay before they are forgotten."""
    archive_dir: Path | None = None
    """Where expired jobs are archived (`jobs.jsonl`); None: they are only deleted."""
    batch: int = 100
    """At most this many jobs and this many workers per look (the rest wait for the next)."""

    @property
    def every_s(self) -> float:
        """How often the lease holder looks: every 10 s, or a quarter of a shorter retention."""
        return min(10.0, self.job_retention_s / 4, self.worker_retention_s / 4)


class Retention:
    def __init__(self, store: Store, cfg: RetentionConfig):
        self.store, self.cfg = store, cfg
        self._due = float("-inf")
        self._indexed = False  # finished jobs stored before `jobs:finished` existed, indexed

    def run_due(self, lease: str) -> None:
        """Expire what is due, at most every `every_s`; ages are judged in Redis server time."""
        if time.monotonic() < self._due:
            return
        self._due = time.monotonic() + self.cfg.every_s
        now = self.store.now()
        if not self._indexed:
            self.index_finished(lease, now)
            self._indexed = True
        self.expire_jobs(lease, now)
        self.forget_workers(lease, now)

    def index_finished(self, lease: str, now: float) -> None:
        """Once per controller: terminal jobs a controller without retention left out of
        `jobs:finished` join it, at the time they ended (now, if they never said)."""
        keys = self.store.keys
        missing = self.store.r.zdiff([keys.jobs(), keys.jobs_open(), keys.jobs_finished()])
        for jid, record in self.store.jobs(missing).items():
            ended = float(record.get("finished_at") or now)
            self.store.commit(Tx().zadd(keys.jobs_finished(), jid, ended), lease)

    def expire_jobs(self, lease: str, now: float) -> list[str]:
        keys = self.store.keys
        jids = self.store.r.zrangebyscore(
            keys.jobs_finished(), "-inf", now - self.cfg.job_retention_s, 0, self.cfg.batch
        )
        for jid in jids:
            if self.cfg.archive_dir is not None:
                self._archive(jid, now)
            tx = Tx().delete(*keys.job_keys(jid))
            tx.zrem(keys.jobs(), jid).zrem(keys.jobs_open(), jid).zrem(keys.jobs_finished(), jid)
            self.store.commit(tx, lease)
            log.info("job %s: ended over %.0fs ago; deleted", jid, self.cfg.job_retention_s)
        return jids

    def _archive(self, jid: str, now: float) -> None:
        s = self.store
        job = Job.from_hash(jid, s.job(jid))
        line = {
            "id": jid,
            "archived_at": now,
            "job": s.job(jid),
            "assignment": s.job_assignment(jid),
            "checkpoint": s.checkpoint(jid),
            "events": s.events(jid, limit=100_000),
            "history": history.job_history(s, job, ARCHIVED_POINTS) if job else None,
        }
        self.cfg.archive_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cfg.archive_dir / "jobs.jsonl", "a") as f:
            f.write(json.dumps(line, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def forget_workers(self, lease: str, now: float) -> list[str]:
        keys, cutoff = self.store.keys, now - self.cfg.worker_retention_s
        stale = [
            wid
            for index in (keys.workers_seen(), keys.workers_gone())
            for wid in self.store.r.zrangebyscore(index, "-inf", cutoff, 0, self.cfg.batch)
        ]
        stale = list(dict.fromkeys(stale))
        assigned, seen = self.store.assignments(stale), self.store.last_seen(stale)
        # not one that beats again (a worker listed as gone is only forgotten if silent too:
        # agents may write `workers:gone`), nor one an assignment still names
        forgotten = [
            w for w in stale if not assigned[w].get("job") and seen.get(w, cutoff) <= cutoff
        ]
        for wid in forgotten:
            tx = Tx().delete(*keys.worker_keys(wid))
            for index in (
                keys.workers_seen(),
                keys.workers_gone(),
                keys.workers_reported(),
                keys.workers_joined(),
            ):
                tx.zrem(index, wid)
            self.store.commit(tx, lease)
            # ACL commands cannot run in a script: right after the keys (a crash between the
            # two leaves a user whose keys are gone, which can touch nothing that exists).
            # Without a provisioner no agent joined, so there is no user to delete.
            if self.store.provisions:
                self.store.delete_user(agent_user(wid))
            log.info("worker %s: silent over %.0fs; forgotten", wid, self.cfg.worker_retention_s)
        if forgotten and self.store.provisions:
            self.store.save_acl()
        return forgotten


def _jsonable(value):
    """pydantic models (history points) as their JSON form."""
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else str(value)
