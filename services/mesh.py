"""Rank <-> (dp, pp, tp) coordinates. TP innermost (a TP group shares a host), DP outermost.

This is the same row-major order `init_device_mesh(..., (dp, pp, tp))` uses, so the
controller (no torch) and the trainer agree on who sits where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

AXES = ("dp", "pp", "tp")


class Coord(NamedTuple):
    dp: int
    pp: int
    tp: int

    def __str__(self) -> str:
        return f"(dp={self.dp}, pp={self.pp}, tp={self.tp})"


@dataclass(frozen=True)
class MeshShape:
    dp: int
    pp: int
    tp: int
    # expert parallelism is carved out of dp (parallel.ep): dp coordinate d holds expert shard
    # d % ep, and d // ep numbers the replicas of that shard
    ep: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.pp, self.tp, self.ep) < 1:
            raise ValueError(f"mesh degrees must be >= 1, got {self}")
        if self.dp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp ({self.dp})")

    def expert_shard(self, rank: int) -> int:
        """Which experts/ep slice of every MoE layer `rank` holds."""
        return self.coord(rank).dp % self.ep

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return Coord(rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp)

    def rank(self, c: Coord | tuple[int, int, int]) -> int:
        d, p, t = c
        if not (0 <= d < self.dp and 0 <= p < self.pp and 0 <= t < self.tp):
            raise ValueError(f"coordinate {tuple(c)} outside mesh {self}")
        return (d * self.pp + p) * self.tp + t

    def group(self, axis: str, rank: int) -> list[int]:
        """Ranks sharing `rank`'s coordinate on every axis but `axis`."""
        i = AXES.index(axis)
        c = list(self.coord(rank))
        members = []
        for v in range(getattr(self, axis)):
            c[i] = v
            members.append(self.rank(tuple(c)))
        return members

    def groups(self, axis: str) -> list[list[int]]:
        """Every process group along `axis`, each listed once, in rank order."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            g = self.group(axis, r)
            seen.setdefault(g[0], g)
        return list(seen.values())

    def replica(self, dp: int) -> list[int]:
        """All ranks of one data-parallel replica (one whole pipeline)."""
        return [self.rank((dp, p, t)) for p in range(self.pp) for t in range(self.tp)]

    def render(self) -> str:
        """The rank grid on one screen: one block per dp replica, pp rows x tp columns."""
        lines = []
        for d in range(self.dp):
            lines.append(f"dp={d}" + (f" ep={d % self.ep}" if self.ep > 1 else ""))
            for p in range(self.pp):
                row = " ".join(f"{self.rank((d, p, t)):>4}" for t in range(self.tp))
                lines.append(f"  pp={p}: {row}")
        return "\n".join(lines)
