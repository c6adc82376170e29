"""Where each rank's in-memory snapshot is copied, and where each rank of a new generation
restores from (docs/architecture.md, "Hot recovery").

Pure functions of the assignment, without torch: the controller writes their answers into
the assignment (`buddies`, `restore`), the agents and trainers follow them. The controller
says only *where* a rank's state lives; the trainers agree among themselves on the step.
"""

from __future__ import annotations

from services.assignment import Assignment, RankEntry
from services.mesh import MeshShape


def pick_holders(
    ranks: list[RankEntry], shape: MeshShape, host_of: dict[str, str]
) -> dict[int, int]:
    """rank -> the rank that holds its snapshot copy (its buddy).

    The same coordinates in the next DP replica when it is on another host: with one replica
    per host, every rank holds exactly one copy. Else the first rank after it, in rank order
    and wrapping, on another host, so losing a whole host still leaves every copy. On a single
    host, another worker: the next replica's rank again, else the first rank after it on
    another worker. A job on one worker has none."""
    ordered = sorted(ranks, key=lambda r: r.rank)
    hosts = [host_of[r.wid] for r in ordered]
    wids = [r.wid for r in ordered]
    next_host, next_worker = _next_differing(hosts), _next_differing(wids)
    holders = {}
    for r in ordered:
        c = r.coord
        mirror = shape.rank(((c.dp + 1) % shape.dp, c.pp, c.tp))
        if hosts[mirror] != hosts[r.rank]:
            holder = mirror
        elif next_host[r.rank] is not None:
            holder = next_host[r.rank]
        elif wids[mirror] != r.wid:
            holder = mirror
        else:
            holder = next_worker[r.rank]
        if holder is not None:
            holders[r.rank] = holder
    return holders


def _next_differing(keys: list[str]) -> list[int | None]:
    """For each i, the first j after i (wrapping) with keys[j] != keys[i]; None when all are
    equal. Linear, not a scan per rank: a world has thousands of ranks."""
    n = len(keys)
    found: list[int | None] = [None] * (2 * n)
    for i in range(2 * n - 2, -1, -1):  # over the ranks twice: the search wraps
        found[i] = i + 1 if keys[i % n] != keys[(i + 1) % n] else found[i + 1]
    return [None if j is None else j % n for j in found[:n]]


def restore_sources(
    old: Assignment, new_ranks: list[RankEntry], new_shape: MeshShape
) -> dict[int, int] | None:
    """rank of the new world -> the rank of the new world whose worker holds its state: itself
    when its worker ran it in `old` (its own snapshot), else the one on the worker that held its
    copy. None when the world restores from disk: the shape changed (a shrink or a grow
    reshards), or some moved rank's copy is on no worker of the new world."""
    if new_shape != old.shape:
        return None
    old_wid = {r.rank: r.wid for r in old.ranks}
    new_wid = {r.rank: r.wid for r in new_ranks}
    lowest_on: dict[str, int] = {}
    for r in sorted(new_wid):
        lowest_on.setdefault(new_wid[r], r)
    sources = {}
    for r in sorted(new_wid):
        if new_wid[r] == old_wid[r]:
            sources[r] = r
            continue
        holder = old.buddies.get(r)
        if holder is None or old_wid[holder] not in lowest_on:
            return None
        kept = new_wid[holder] == old_wid[holder]
        sources[r] = holder if kept else lowest_on[old_wid[holder]]
    return sources
