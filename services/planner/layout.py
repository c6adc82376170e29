"""What the planner chooses (a `Layout`) and what it chooses for (a `Cluster`).

docs/planner.md, "Search": a layout is the spec's `parallel` degrees and knobs; the cluster
is N workers of D devices of one hardware profile, their hosts joined by one fabric. TP groups
sit inside a host (the mesh puts TP innermost: services/mesh.py), so PP and then DP are the
axes that cross hosts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from services.planner.hardware import INFINIBAND, DeviceProfile, Fabric, cross_host_link
from services.spec import ParallelSpec


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    zero: int
    microbatches: int
    virtual_stages: int
    activation_checkpointing: bool | str  # True: whole blocks; "selective": SAC (spec.py)
    pp_schedule: str

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @classmethod
    def of(cls, p: ParallelSpec) -> Layout:
        return cls(
            p.dp,
            p.pp,
            p.tp,
            p.zero,
            p.microbatches,
            p.virtual_stages,
            p.activation_checkpointing,
            p.pp_schedule,
        )

    def parallel(self, base: ParallelSpec) -> ParallelSpec:
        """`base` (precision, loss_parallel, ...) with this layout's degrees, auto cleared."""
        return base.model_copy(update={**asdict(self), "auto": False})

    def label(self) -> str:
        sched = ""
        if self.pp > 1:
            sched = f" {self.pp_schedule}" + (
                f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            )
        ac = {True: " AC", "selective": " SAC"}.get(self.activation_checkpointing, "")
        return (
            f"DP{self.dp} PP{self.pp} TP{self.tp} zero{self.zero} M{self.microbatches}{sched}{ac}"
        )


@dataclass(frozen=True)
class Cluster:
    workers: int
    devices_per_worker: int
    device: DeviceProfile
    memory_per_device: int  # bytes; the profile's, or host RAM / devices for cpu
    fabric: Fabric = INFINIBAND  # what cross-host traffic runs over

    @property
    def devices(self) -> int:
        return self.workers * self.devices_per_worker

    def spans_hosts(self, ranks: int) -> bool:
        """Whether a group of `ranks` consecutive mesh ranks crosses a host boundary."""
        return ranks > self.devices_per_worker

    def link(self, contiguous_ranks: int) -> tuple[float, float]:
        """(bandwidth B/s, latency s) of a group whose members lie within `contiguous_ranks`
        consecutive mesh ranks: in-host when that block fits one worker."""
        d = self.device
        if self.spans_hosts(contiguous_ranks):
            return cross_host_link(d, self.fabric, self.devices_per_worker)
        return d.intra_host_bw, d.intra_host_latency_s
