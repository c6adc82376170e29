"""The training loop's corruption check: compare replicas at a step, and on a disagreement
replay from the newest checked snapshot to blame a rank (worker/trainer/sdc.py;
docs/architecture.md, "Silent data corruption")."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from worker.trainer.sdc import (
    Disagreement,
    ReplicaCheck,
    SilentCorruption,
    blame,
    drifted,
    fingerprint,
    state_tensors,
    sums,
)
from worker.trainer.snapshot import Snapshotter
from worker.trainer.snapshot_state import _local, load
from worker.trainer.step import Trainer


class CorruptionGuard:
    def __init__(self, check: ReplicaCheck, trainer: Trainer, snaps: Snapshotter | None):
        self.check, self.trainer, self.snaps = check, trainer, snaps
        self.clean_step: int | None = None  # newest step whose check passed
        # this rank's parameters' fingerprints and sums per step since then: the replay finds
        # the first step at which each rank's parameters left the clean trajectory, or, where
        # it reproduces no history, how far from it each rank's lay (worker/trainer/sdc.py)
        self.trail: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.params = [
            (n, _local(p.detach())) for part in trainer.parts for n, p in part.named_parameters()
        ]

    def due(self, step: int) -> bool:
        return self.check.due(step)

    def record(self, step: int) -> None:
        """After every step: the parameters' fingerprint and sums, kept until the next check."""
        self.trail[step] = (fingerprint(self.params), sums(self.params))

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
        suspects, how = self._blamed(found, ranks, self._replay(step, fp))
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

    @staticmethod
    def _blamed(
        found: list[Disagreement], ranks: list[int], reports: list[dict]
    ) -> tuple[list[int], str]:
        """(the ranks blamed, how): by the replay bit for bit, by their distance from it, by
        a majority of replicas, or nobody."""
        if reports:
            replayed = blame(reports, ranks)
            if replayed:
                return replayed, "replay"
            far, how_far = drifted(reports, sorted({tuple(d.ranks) for d in found}))
            if far:
                return far, f"distance from the replay ({how_far})"
        outvoted = sorted({r for d in found for r in d.outvoted})
        return outvoted, "majority" if outvoted else "nothing could tell"

    def _replay(self, step: int, fp: torch.Tensor) -> list[dict]:
        """Replay steps clean_step..step from this rank's checked snapshot on every rank; every
        rank's report of it (`blame`, `drifted`), or [] when some rank has no checked snapshot
        to replay from."""
        slot = self.snaps.checked_slot() if self.snaps is not None else None
        ok = slot is not None and slot[0]["step"] == self.clean_step  # its copy may have failed
        have = torch.tensor([int(ok)])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)  # all replay, or none does
        if not int(have):
            return []
        manifest, image = slot
        t = self.trainer
        load(t.parts, t.optimizers, t.schedulers, manifest, image)
        diverged_at, drift = None, []
        for index in range(self.clean_step, step):
            t.train_step(index)
            kept = self.trail.get(index + 1)
            if kept is None:
                diverged_at = diverged_at or index + 1
                drift.append(math.nan)
                continue
            if diverged_at is None and bool((fingerprint(self.params) != kept[0]).any()):
                diverged_at = index + 1
            drift.append(float(torch.linalg.vector_norm(sums(self.params) - kept[1])))
        changed = bool((fingerprint(state_tensors(t.parts, t.optimizers)) != fp).any())
        mine = {
            "rank": t.ctx.rank,
            "diverged_at": diverged_at,
            "changed": changed,
            "drift": drift,
        }
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
        return reports
