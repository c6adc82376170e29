"""The training loop's corruption check: compare replicas at a step, and on a disagreement
replay from the newest checked snapshot to blame a rank (worker/trainer/sdc.py;
docs/architecture.md, "Silent data corruption")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from worker.trainer.sdc import (
    Disagreement,
    ReplicaCheck,
    SilentCorruption,
    blame,
    fingerprint,
    state_tensors,
)
from worker.trainer.snapshot import Snapshotter
from worker.trainer.snapshot_state import _local, load
from worker.trainer.step import Trainer


class CorruptionGuard:
    def __init__(self, check: ReplicaCheck, trainer: Trainer, snaps: Snapshotter | None):
        self.check, self.trainer, self.snaps = check, trainer, snaps
        self.clean_step: int | None = None  # newest step whose check passed
        # this rank's parameter fingerprints per step since then: the replay finds the first
        # step at which each rank's parameters left the clean trajectory
        self.trail: dict[int, torch.Tensor] = {}
        self.params = [
            (n, _local(p.detach())) for part in trainer.parts for n, p in part.named_parameters()
        ]

    def due(self, step: int) -> bool:
        return self.check.due(step)

    def record(self, step: int) -> None:
        """After every step: the parameters' fingerprint, kept until the next check."""
        self.trail[step] = fingerprint(self.params)

    def verify(self, step: int) -> None:
        """Every rank, at the same step: returns when the replicas agree, raises
        SilentCorruption (the same evidence on every rank) when they do not."""
        t = self.trainer
        tensors = state_tensors(t.parts, t.optimizers)
        fp = fingerprint(tensors)
        found = self.check.compare(tensors, fp)
        if not found:
            self.clean_step = step
            self.trail.clear()
            return
        raise SilentCorruption(self._evidence(step, found, fp))

    def _evidence(self, step: int, found: list[Disagreement], fp: torch.Tensor) -> dict:
        ranks = sorted({r for d in found for r in d.ranks})
        replayed = self._replay(step, fp, ranks)
        suspects = replayed or sorted({r for d in found for r in d.outvoted})
        how = "replay" if replayed else "majority" if suspects else "nothing could tell"
        first = found[0]
        detail = (
            f"DP replicas {first.ranks} disagree on {first.tensor} at step {step} (last agreed "
            f"at step {self.clean_step}); blamed by {how}: "
            + (f"rank(s) {suspects}" if suspects else "no rank")
        )
        return {
            "step": step,
            "clean_step": self.clean_step,
            "tensor": first.tensor,
            "ranks": ranks,
            "suspects": suspects,
            "detail": detail,
        }

    def _replay(self, step: int, fp: torch.Tensor, ranks: list[int]) -> list[int]:
        """Replay steps clean_step..step from this rank's checked snapshot on every rank;
        the ranks the replay blames ([] when no rank has a checked snapshot to replay from)."""
        slot = self.snaps.checked_slot() if self.snaps is not None else None
        ok = slot is not None and slot[0]["step"] == self.clean_step  # its copy may have failed
        have = torch.tensor([int(ok)])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)  # all replay, or none does
        if not int(have):
            return []
        manifest, image = slot
        t = self.trainer
        load(t.parts, t.optimizers, t.schedulers, manifest, image)
        diverged_at = None
        for index in range(self.clean_step, step):
            t.train_step(index)
            kept = self.trail.get(index + 1)
            if diverged_at is None and (
                kept is None or bool((fingerprint(self.params) != kept).any())
            ):
                diverged_at = index + 1
        changed = bool((fingerprint(state_tensors(t.parts, t.optimizers)) != fp).any())
        mine = {
            "rank": t.ctx.rank,
            "diverged_at": diverged_at,
            "changed": changed,
        }
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
        return blame(reports, ranks)
