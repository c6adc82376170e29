"""How the next generation of a job looks after a fault, or when capacity returns.

Pure functions of the current assignment; fault handling (controller/faults.py) decides
with them and the scheduler writes what they return (docs/architecture.md, "Failure
handling").
- replace: every faulty worker's ranks move, at the same (dp, pp, tp) coordinates, to a
  spare (the job's own first, then any idle worker), preferring one on the same host;
- shrink: without spares, drop each DP replica that lost a rank while dp > min_dp; the
  global batch is kept (each rank takes a larger share, split into microbatches). With
  experts split over ep, a replica holds one expert shard of ep: the ep replicas that
  together hold every expert (one "edp" group) go or stay together, so dp stays a multiple
  of ep;
- grow: when enough idle workers for a whole replica (ep replicas with experts split) exist,
  add it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as dc_replace

from controller.placement import FreeWorker, place
from services.assignment import RankEntry
from services.mesh import Coord, MeshShape


@dataclass(frozen=True)
class Layout:
    shape: MeshShape
    ranks: list[RankEntry]
    microbatches: int
    moved: dict[str, str]  # old worker -> new worker
    spares: list[str]


def fit_microbatches(
    global_batch: int, dp: int, pp: int, want: int, interleaved: bool
) -> int | None:
    """The smallest microbatch count >= `want` that splits this dp's share evenly."""
    if global_batch % dp:
        return None
    share = global_batch // dp
    for m in range(want, share + 1):
        if share % m == 0 and (pp == 1 or m >= pp) and (not interleaved or m % pp == 0):
            return m
    return None


def with_local_world(ranks: list[RankEntry], host_of: dict[str, str]) -> list[RankEntry]:
    per_host: dict[str, int] = {}
    for r in ranks:
        per_host[host_of.get(r.wid, r.wid)] = per_host.get(host_of.get(r.wid, r.wid), 0) + 1
    # an entry is rebuilt only where its count changed: a recovery keeps almost all of them
    return [
        r
        if r.local_world_size == (n := per_host[host_of.get(r.wid, r.wid)])
        else dc_replace(r, local_world_size=n)
        for r in ranks
    ]


def _by_slot(r: RankEntry) -> tuple[int, int]:
    return r.local_rank, r.rank


def replace_workers(
    shape: MeshShape,
    ranks: list[RankEntry],
    microbatches: int,
    bad: set[str],
    candidates: list[FreeWorker],
    keep_spares: list[str],
    host_of: dict[str, str],
) -> Layout | None:
    # bad workers in rank order (not set order, which varies by process): the same fault
    # always promotes the same candidates
    need = {
        w: [r for r in ranks if r.wid == w] for w in dict.fromkeys(r.wid for r in ranks) if w in bad
    }
    pool, moved = list(candidates), {}
    for old, its_ranks in need.items():
        fits = [c for c in pool if c.slots >= len(its_ranks)]
        if not fits:
            return None
        same_host = [c for c in fits if c.host == host_of.get(old)]
        new = (same_host or fits)[0]
        pool.remove(new)
        moved[old] = new.wid
    # A moved rank takes a slot of its new worker (0, 1, ... in its old slot order): the old
    # worker's slot numbers may not exist there (slot 6 on a 2-device worker).
    slot = {r.rank: i for w in need.values() for i, r in enumerate(sorted(w, key=_by_slot))}
    new_ranks = [
        dc_replace(r, wid=moved[r.wid], local_rank=slot[r.rank]) if r.wid in moved else r
        for r in ranks
    ]
    host_of = {**host_of, **{c.wid: c.host for c in candidates}}
    spares = [w for w in keep_spares if w not in moved.values()]
    return Layout(shape, with_local_world(new_ranks, host_of), microbatches, moved, spares)


def shrink(
    shape: MeshShape,
    ranks: list[RankEntry],
    bad: set[str],
    min_dp: int,
    global_batch: int,
    microbatches: int,
    interleaved: bool,
    host_of: dict[str, str],
) -> Layout | None:
    groups = {r.coord.dp // shape.ep for r in ranks if r.wid in bad}
    lost = [d for d in range(shape.dp) if d // shape.ep in groups]
    new_dp = shape.dp - len(lost)
    if new_dp < max(1, min_dp):
        return None
    m = fit_microbatches(global_batch, new_dp, shape.pp, microbatches, interleaved)
    if m is None:
        return None
    kept = [d for d in range(shape.dp) if d not in lost]
    new_shape = MeshShape(new_dp, shape.pp, shape.tp, shape.ep)
    new_ranks = []
    for r in ranks:
        if r.coord.dp in kept:
            c = Coord(kept.index(r.coord.dp), r.coord.pp, r.coord.tp)
            new_ranks.append(dc_replace(r, rank=new_shape.rank(c), coord=c))
    new_ranks.sort(key=lambda r: r.rank)
    # healthy members of a dropped replica stay with the job as spares
    freed = list(dict.fromkeys(r.wid for r in ranks if r.coord.dp in lost and r.wid not in bad))
    return Layout(new_shape, with_local_world(new_ranks, host_of), m, {}, freed)


def grow(
    shape: MeshShape,
    ranks: list[RankEntry],
    target_dp: int,
    global_batch: int,
    spec_microbatches: int,
    interleaved: bool,
    free: list[FreeWorker],
    host_of: dict[str, str],
) -> Layout | None:
    """One more DP replica (ep of them with experts split) on idle workers, if they hold
    whole pipelines."""
    if shape.dp >= target_dp:
        return None
    new_shape = MeshShape(shape.dp + shape.ep, shape.pp, shape.tp, shape.ep)
    m = fit_microbatches(global_batch, new_shape.dp, shape.pp, spec_microbatches, interleaved)
    replicas = place(MeshShape(shape.ep, shape.pp, shape.tp), 0, free)
    if m is None or replicas is None:
        return None
    added = []
    for r in replicas.ranks:
        c = Coord(shape.dp + r.coord.dp, r.coord.pp, r.coord.tp)
        added.append(dc_replace(r, rank=new_shape.rank(c), coord=c))
    kept = [dc_replace(r, rank=new_shape.rank(r.coord)) for r in ranks]
    host_of = {**host_of, **{w.wid: w.host for w in free}}
    return Layout(new_shape, with_local_world(kept + added, host_of), m, {}, [])
