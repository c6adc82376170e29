"""The assignment record both planes share: who runs which rank in which generation.

Written by the controller to `job:{jid}:assignment` (one hash field per rank, so a big world
stays readable piecewise) and read back by agents and by the status view.

Progress (`worker:{wid}:progress`, written by the agent) carries `job`, `generation` and a
JSON `ranks` map rank -> {state, step, loss, ...}; rank states are the ones below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from services.mesh import Coord, MeshShape
from services.store import Store, loads

# The environment variable that gives a trainer its generation's key space in the job's store
# (Assignment.store_space); unset, rank 0's trainer hosts a store of its own (torch's env://).
STORE_SPACE_ENV = "MESHKEEPER_STORE_SPACE"

# agent-reported: starting -> running -> succeeded | suspended | failed | stopped (suspended:
# stopped and committed on request, services/records.py EXIT_SUSPENDED)
# controller-derived: assigned (no report yet in this generation), lost (worker silent),
# straggler (flagged, not replaced: straggler.action report or no spare)
RANK_STATES = (
    "assigned",
    "starting",
    "running",
    "straggler",
    "succeeded",
    "suspended",
    "failed",
    "stopped",
    "lost",
)
FINAL_RANK_STATES = ("succeeded", "suspended", "failed", "stopped")
# A trainer process in one of these kernel states cannot make progress on its own; when a
# whole job hangs, it is the rank the others wait for (agents report `proc_state`).
FROZEN_PROC_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible I/O"}


@dataclass(frozen=True)
class RankEntry:
    rank: int
    wid: str
    local_rank: int  # device index within the worker
    coord: Coord
    local_world_size: int = 1  # ranks of this job on the same host

    def to_json(self) -> dict:
        return {
            "wid": self.wid,
            "local_rank": self.local_rank,
            "coord": list(self.coord),
            "local_world_size": self.local_world_size,
        }


@dataclass(frozen=True)
class Assignment:
    job: str
    generation: int
    shape: MeshShape
    master_addr: str
    master_port: int
    ranks: list[RankEntry]
    spares: list[str] = field(default_factory=list)
    tp_split: bool = False
    microbatches: int | None = None  # None: the spec's; set when a shrink changed dp
    # hot recovery (docs/architecture.md, "Hot recovery"; services/buddies.py):
    buddies: dict[int, int] = field(default_factory=dict)  # rank -> holder of its snapshot copy
    restore_generation: int | None = None  # the generation whose snapshots this one restores
    restore_sources: dict[int, int] | None = None  # rank -> rank whose worker holds its state
    # The submitted layout's dp index of each replica, by its dp here; None: 0, 1, ... A shrink
    # renumbers the replicas it keeps (ranks must be dense), and the page still names each by
    # the place it was submitted at (controller/apply.py `dp_labels`).
    dp_labels: list[int] | None = None
    # The job's rendezvous store (docs/architecture.md, "Rendezvous"): the worker whose agent
    # hosts it at master_addr:master_port, and the generation it was started for; each
    # generation rendezvouses in a key space of its own on it. None: rank 0's trainer hosts a
    # store of this generation's own (an assignment written before the job store existed).
    store_wid: str | None = None
    store_since: int | None = None

    @functools.cached_property
    def labels(self) -> list[int]:
        """Each replica's submitted dp index, by its dp here; built once (read per rank)."""
        return self.dp_labels or list(range(self.shape.dp))

    def effective_spec(self, spec: dict) -> dict:
        """The spec this generation trains with: its mesh may be smaller than the submitted one
        (dp shrunk after a failure); the global batch never changes."""
        parallel = {
            **spec["parallel"],
            "dp": self.shape.dp,
            "pp": self.shape.pp,
            "tp": self.shape.tp,
        }
        if self.microbatches:
            parallel["microbatches"] = self.microbatches
        ft = {**spec.get("fault_tolerance", {})}
        ft["min_dp"] = min(ft.get("min_dp", 1), self.shape.dp)
        return {**spec, "parallel": parallel, "fault_tolerance": ft}

    @functools.cached_property
    def workers(self) -> list[str]:
        """The ranks' workers in rank order, then the spares; built once per assignment (a
        1,024-rank recovery asks often): read it, never change it."""
        return list(dict.fromkeys([r.wid for r in self.ranks] + self.spares))

    @functools.cached_property
    def rank_workers(self) -> frozenset[str]:
        """The workers that run ranks (not spares)."""
        return frozenset(r.wid for r in self.ranks)

    @property
    def store_space(self) -> str | None:
        """This generation's key space in the job's store: a trainer of another generation
        (a superseded one still running) never meets this one's keys. None: no job store."""
        return None if self.store_wid is None else f"meshkeeper/g{self.generation}"

    def ranks_of(self, wid: str) -> list[RankEntry]:
        return [r for r in self.ranks if r.wid == wid]

    def to_fields(self) -> dict:
        """The whole hash (None values are not written)."""
        return self._header() | {f"rank:{r.rank}": r.to_json() for r in self.ranks}

    def changes_from(self, old: Assignment) -> tuple[dict, list[str]]:
        """What turns `old`'s hash into this one's, for a generation of the same shape: the
        fields to write (the header, and the ranks whose entry changed) and the header fields
        to delete (now None). A recovery that moves a few ranks writes those few entries."""
        header = self._header()
        ranks = {
            f"rank:{r.rank}": r.to_json()
            for r, o in zip(self.ranks, old.ranks, strict=True)
            if r != o
        }
        set_ = {f: v for f, v in header.items() if v is not None}
        return set_ | ranks, [f for f, v in header.items() if v is None]

    def _header(self) -> dict:
        return {
            "job": self.job,
            "generation": self.generation,
            "world_size": self.shape.world_size,
            "shape": [self.shape.dp, self.shape.pp, self.shape.tp, self.shape.ep],
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "spares": self.spares,
            "tp_split": self.tp_split,
            "microbatches": self.microbatches,
            "buddies": self.buddies or None,
            "restore": None
            if self.restore_sources is None
            else {"generation": self.restore_generation, "sources": self.restore_sources},
            "dp_labels": self.dp_labels,
            "store": None
            if self.store_wid is None
            else {"wid": self.store_wid, "since": self.store_since},
        }

    @classmethod
    def from_fields(cls, h: dict[str, str]) -> Assignment | None:
        """Parse a stored hash; None when absent or incomplete (a torn or foreign record)."""
        try:
            shape = MeshShape(*loads(h["shape"]))
            ranks = []
            for r in range(shape.world_size):
                e = loads(h[f"rank:{r}"])
                ranks.append(
                    RankEntry(
                        r,
                        e["wid"],
                        int(e["local_rank"]),
                        Coord(*e["coord"]),
                        int(e.get("local_world_size", 1)),
                    )
                )
            restore = loads(h.get("restore"))
            store = loads(h.get("store"))
            return cls(
                h["job"],
                int(h["generation"]),
                shape,
                h["master_addr"],
                int(h["master_port"]),
                ranks,
                loads(h.get("spares"), []),
                h.get("tp_split") == "1",
                loads(h.get("microbatches")),
                _int_map(loads(h.get("buddies"), {})),
                int(restore["generation"]) if restore else None,
                _int_map(restore["sources"]) if restore else None,
                loads(h.get("dp_labels")),
                str(store["wid"]) if store else None,
                int(store["since"]) if store else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def _int_map(m: dict[str, int]) -> dict[int, int]:
    """A rank map read back from JSON, whose keys are strings."""
    return {int(k): int(v) for k, v in m.items()}


def current(store: Store, jid: str, generation: int) -> Assignment | None:
    """Job `jid`'s assignment of `generation`; None while it has none of that generation (not
    placed yet, or a new one being written). Read and parsed once per store, job and
    generation: an assignment is never rewritten within its generation (the lease holder
    writes a new generation's whole, controller/apply.py `start_generation`), so a later read
    could only return the same. Callers must not change what it returns."""
    try:
        return _current(store, jid, generation)
    except LookupError:  # not cached: the next call reads again
        return None


@functools.lru_cache(maxsize=128)  # 128 open jobs; a 1,024-rank assignment is ~0.3 MB parsed
def _current(store: Store, jid: str, generation: int) -> Assignment:
    asg = Assignment.from_fields(store.job_assignment(jid))
    if asg is None or asg.generation != generation:
        raise LookupError(jid)
    return asg
