"""Host memory a job's in-memory snapshots take on each worker (docs/planner.md, "Snapshot
rings"): admission holds it to the room the agents registered for them (controller/admission.py).

Per rank, following what the trainer writes (worker/snapshots.py, worker/trainer/snapshot.py):
- its own rings: `keep` whole snapshots, one more (pinned) where the replica check runs, each
  the rank's fp32 weights and AdamW moments (its ZeRO shard, `MemoryAnatomy`); with
  `full_every` above 1 and a snapshot every step, `full_every + keep - 1` logged steps, each
  its gradients (as many bytes as its weights);
- with `buddy`, the same whole slots for its ward's copy, and `full_every + keep - 3` logged
  steps (`pick_holders` gives every rank one ward when replicas sit on different hosts);
- after a recovery, the new generation's first snapshots beside all of the old one's, which
  the agent drops once every rank of the worker has stepped (worker/agent/agent.py,
  `_drop_restored`): a whole snapshot and a ward's copy, and the logged steps the first step
  claims (its own for that step and the next, a ward's for one).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.memory import MemoryAnatomy
from services.spec import JobSpec, has_replicas


@dataclass(frozen=True)
class SnapshotRings:
    whole: int  # bytes of one whole snapshot of a rank
    logged: int  # bytes of one logged step
    whole_slots: int  # of a rank's own whole ring, and of the one its holder keeps for it
    logged_slots: int  # of a rank's own logged ring
    held_logged_slots: int  # of the logged ring its holder keeps for it
    wards: int  # the ranks whose copies a rank holds (0 without buddy copies)

    @property
    def own(self) -> int:
        """Bytes of one rank's own rings."""
        return self.whole * self.whole_slots + self.logged * self.logged_slots

    @property
    def held(self) -> int:
        """Bytes a rank holds for its wards."""
        return self.wards * (self.whole * self.whole_slots + self.logged * self.held_logged_slots)

    @property
    def first_steps(self) -> int:
        """Bytes a recovery's new generation writes before the old one's rings are dropped."""
        logged = self.logged * (2 + self.wards) if self.logged_slots else 0
        return self.whole * (1 + self.wards) + logged

    @property
    def per_rank(self) -> int:
        """Bytes per rank at the peak: its rings, own and held, and a recovery's first
        snapshots beside them."""
        return self.own + self.held + self.first_steps

    def explain(self, ranks: int) -> str:
        """How `ranks` ranks' share adds up, for a refusal."""
        logged = (
            f" + {self.logged_slots} logged steps of {_gib(self.logged)}"
            if self.logged_slots
            else ""
        )
        held = f", {_gib(self.held)} of a buddy's copies" if self.wards else ""
        return (
            f"{ranks} rank{'s' if ranks != 1 else ''} x ({self.whole_slots} whole snapshots "
            f"of {_gib(self.whole)}{logged}{held}, and {_gib(self.first_steps)} of a "
            "recovery's first snapshots beside them)"
        )


def snapshot_rings(spec: JobSpec, memory: MemoryAnatomy) -> SnapshotRings | None:
    """The rings of the rank whose anatomy is `memory`; None when the job takes no snapshots."""
    s = spec.snapshot
    if not s.enabled:
        return None
    logs = s.full_every > 1 and s.every_steps == 1
    return SnapshotRings(
        whole=memory.params + memory.optimizer,
        logged=memory.params,
        whole_slots=s.keep + int(spec.sdc.enabled and has_replicas(spec.parallel)),
        logged_slots=s.full_every + s.keep - 1 if logs else 0,
        held_logged_slots=s.full_every + s.keep - 3 if logs else 0,
        wards=1 if s.buddy and spec.parallel.world_size > 1 else 0,
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"
