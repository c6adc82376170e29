"""Where each rank of a job goes: a pure function of the mesh and the free workers.

- Ranks are numbered like `init_device_mesh(("dp","pp","tp"))`: TP innermost, DP outermost,
  so a TP group is `tp` consecutive ranks; each group is kept on one host when one has room
  (TP traffic is the heaviest), preferring the previous group's host (pipeline neighbours).
- Spares are whole workers held back for the job, taken from the end of the list so ranks
  fill hosts in order.
"""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

from services.assignment import RankEntry
from services.mesh import MeshShape


@functools.lru_cache(maxsize=1 << 16)  # the pool's names, sorted on every pass and submission
def natural_key(s: str) -> tuple:
    """w2 before w10: workers are taken in name order."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


@dataclass(frozen=True)
class FreeWorker:
    wid: str
    host: str
    address: str
    slots: int = 1


@dataclass(frozen=True)
class Placement:
    ranks: list[RankEntry]
    spares: list[str]
    tp_split: bool  # some TP group spans hosts (no host had room for it whole)

    @property
    def workers(self) -> list[str]:
        return list(dict.fromkeys([r.wid for r in self.ranks] + self.spares))


def place(shape: MeshShape, spares: int, workers: list[FreeWorker]) -> Placement | None:
    """A placement for every rank plus `spares` whole workers, or None if they do not fit."""
    if spares > len(workers):
        return None
    pool = workers[: len(workers) - spares]
    spare_ids = [w.wid for w in workers[len(pool) :]]
    if sum(w.slots for w in pool) < shape.world_size:
        return None
    # host -> free (wid, slot) in worker order, so one worker's slots fill before the next
    free: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for w in pool:
        free[w.host].extend((w.wid, i) for i in range(w.slots))
    ranks: list[RankEntry] = []
    split, prev = False, None
    for first in range(0, shape.world_size, shape.tp):
        host = _host_for_group(free, shape.tp, prev)
        if host is None:  # no host holds the whole group: spread it, largest hosts first
            split, slots = True, []
            for h in sorted(free, key=lambda h: -len(free[h])):
                take = free[h][: shape.tp - len(slots)]
                free[h], slots = free[h][len(take) :], slots + take
        else:
            slots, free[host] = free[host][: shape.tp], free[host][shape.tp :]
            prev = host
        for k, (wid, i) in enumerate(slots):
            ranks.append(RankEntry(first + k, wid, i, shape.coord(first + k)))
    host_of = {w.wid: w.host for w in pool}
    per_host = Counter(host_of[r.wid] for r in ranks)
    ranks = [replace(r, local_world_size=per_host[host_of[r.wid]]) for r in ranks]
    return Placement(ranks, spare_ids, split)


def _host_for_group(free: dict[str, list], size: int, prev: str | None) -> str | None:
    if prev is not None and len(free[prev]) >= size:
        return prev
    fits = [h for h in free if len(free[h]) >= size]
    return min(fits, key=lambda h: len(free[h])) if fits else None  # best fit
