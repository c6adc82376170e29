"""Every rank's state, joined from the assignment and the agents' progress reports.

Each rank is an `api.RankStatus`: the agent's `RankReport` for it plus its place in the mesh.
Reports from another job or an older generation are ignored (docs/architecture.md,
"Generation and fencing"); a report that does not parse as a `RankReport` counts as none, so
one agent writing garbage cannot stop the pass for every job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pydantic import ValidationError

from services.api import Coordinate, RankStatus
from services.assignment import FINAL_RANK_STATES, Assignment
from services.records import RankReport
from services.store import loads

log = logging.getLogger("meshkeeper.ranks")


def _report(raw: object, where: str) -> RankReport:
    try:
        return RankReport.model_validate(raw or {})
    except ValidationError as e:
        log.debug("ignoring a malformed report of %s: %s", where, e)
        return RankReport()


def rank_view(
    asg: Assignment, progress: dict[str, dict[str, str]], alive: set[str] | None = None
) -> list[RankStatus]:
    """One `RankStatus` per rank, in rank order. `alive` given: a rank on a worker not in it
    that has not ended is `lost`."""
    reports: dict[str, dict] = {}
    for wid, p in progress.items():
        if p.get("job") == asg.job and p.get("generation") == str(asg.generation):
            reports[wid] = loads(p.get("ranks"), {})
    out = []
    for r in asg.ranks:
        rep = _report(reports.get(r.wid, {}).get(str(r.rank)), f"rank {r.rank} on {r.wid}")
        state = rep.state
        if alive is not None and r.wid not in alive and state not in FINAL_RANK_STATES:
            state = "lost"
        out.append(
            RankStatus(
                **{**rep.model_dump(), "state": state},
                rank=r.rank,
                coord=Coordinate(
                    **r.coord._asdict(),
                    ep=asg.shape.expert_shard(r.rank) if asg.shape.ep > 1 else None,
                ),
                worker=r.wid,
                local_rank=r.local_rank,
            )
        )
    return out


@dataclass(frozen=True)
class Progress:
    """Job-level progress, all four values from one rank's report, so the loss shown is the
    loss of the step shown."""

    step: int
    loss: float | None
    tokens_per_s: float | None
    step_s: float | None


def summarize(ranks: list[RankStatus]) -> Progress | None:
    """The slowest rank's report (lowest step; the lowest rank among equals): the job has
    completed only the steps every rank has. The trainer all-reduces the loss, so each rank
    holds the global loss of its own step; taking rank 0's loss with the slowest rank's step
    showed one step with another step's loss."""
    if not ranks:
        return None
    slowest = min(ranks, key=lambda r: (r.step, r.rank))
    return Progress(slowest.step, slowest.loss, slowest.tokens_per_s, slowest.step_s)
