"""Every rank's state, joined from the assignment and the agents' progress reports.

Each rank is an `api.RankStatus`: the agent's `RankReport` for it plus its place in the mesh.
Reports from another job or an older generation are ignored (docs/architecture.md,
"Generation and fencing"); a report that does not parse as a `RankReport` counts as none, so
one agent writing garbage cannot stop the pass for every job.

A pass, every GET of a job and every metrics scrape read the same reports again and again:
each is parsed and turned into a `RankStatus` once per distinct report string (two LRU
caches), so what they cost follows how many reports changed, not how many ranks there are.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from pydantic import ValidationError

from services.api import Coordinate, RankStatus
from services.assignment import FINAL_RANK_STATES, Assignment
from services.mesh import Coord
from services.records import RankReport
from services.store import loads

log = logging.getLogger("meshkeeper.ranks")


@functools.lru_cache(maxsize=1 << 14)
def _reports(raw: str | None, wid: str) -> dict[str, RankReport]:
    """The `ranks` field of one progress hash, parsed and validated once."""
    out = {}
    parsed = loads(raw, {})
    for rank, rep in parsed.items() if isinstance(parsed, dict) else ():
        try:
            out[rank] = RankReport.model_validate(rep or {})
        except ValidationError as e:
            log.debug("ignoring a malformed report of rank %s on %s: %s", rank, wid, e)
            out[rank] = RankReport()
    return out


# Two entries per rank of a 16,384-rank pool: the current report and the one before.
@functools.lru_cache(maxsize=1 << 15)
def _status(
    raw: str | None, wid: str, rank: int, local_rank: int, coord: Coord, ep: int | None, lost: bool
) -> RankStatus:
    """One rank's status, built once per distinct report: a pass, every GET of the job and
    every scrape read the same strings again until the rank's agent reports anew, so their
    work follows what changed, not the number of ranks. RankStatus is frozen: shared."""
    rep = _reports(raw, wid).get(str(rank)) or RankReport()
    state = "lost" if lost and rep.state not in FINAL_RANK_STATES else rep.state
    # validated already (the report above, the rest by their own types): constructed
    return RankStatus.model_construct(
        **{**rep.__dict__, "state": state},
        rank=rank,
        coord=Coordinate.model_construct(dp=coord.dp, pp=coord.pp, tp=coord.tp, ep=ep),
        worker=wid,
        local_rank=local_rank,
    )


def rank_view(
    asg: Assignment, progress: dict[str, dict[str, str]], alive: set[str] | None = None
) -> list[RankStatus]:
    """One `RankStatus` per rank, in rank order. `alive` given: a rank on a worker not in it
    that has not ended is `lost`."""
    gen = str(asg.generation)
    raw: dict[str, str | None] = {}
    for wid, p in progress.items():
        if p.get("job") == asg.job and p.get("generation") == gen:
            raw[wid] = p.get("ranks")
    ep = asg.shape.ep > 1
    return [
        _status(
            raw.get(r.wid),
            r.wid,
            r.rank,
            r.local_rank,
            r.coord,
            asg.shape.expert_shard(r.rank) if ep else None,
            alive is not None and r.wid not in alive,
        )
        for r in asg.ranks
    ]


@dataclass(frozen=True)
class Progress:
    """Job-level progress, every value from one rank's report, so the loss shown is the
    loss of the step shown (and the eval the latest that rank had seen by then)."""

    step: int
    loss: float | None
    tokens_per_s: float | None
    step_s: float | None
    epoch: int | None = None
    eval_loss: float | None = None  # the latest validation, measured at eval_step
    eval_step: int | None = None


def summarize(ranks: list[RankStatus]) -> Progress | None:
    """The slowest rank's report (lowest step; the lowest rank among equals): the job has
    completed only the steps every rank has. The trainer all-reduces the loss, so each rank
    holds the global loss of its own step; taking rank 0's loss with the slowest rank's step
    showed one step with another step's loss. The validation loss is all-reduced too: every
    rank reports the same one."""
    if not ranks:
        return None
    s = min(ranks, key=lambda r: (r.step, r.rank))
    return Progress(s.step, s.loss, s.tokens_per_s, s.step_s, s.epoch, s.eval_loss, s.eval_step)
