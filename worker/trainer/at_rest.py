"""State at rest: each rank's parameters and optimizer state, sealed by a fingerprint when the
optimizer step has written them and verified before anything reads them again
(docs/architecture.md, "Silent data corruption").

The replica comparison (worker/trainer/sdc.py) needs replicas, and the spot check
(worker/trainer/spot_check.py) re-executes compute without looking at the state. At `zero: 2`
or `3`, the default, no two ranks hold the same shard, so a bit flipped in memory between two
steps (DRAM, HBM, a stray write) was trained on and never seen: measured before this check, a
dp2 x tp2 job at zero 3 with one flipped parameter bit ended Succeeded, at a different loss.

Every rank seals its own shards after each optimizer step (the same word sum as the replica
check's fingerprint, no collective) and verifies them twice before the next step reads them:
before the step's snapshot and checkpoint copy it, and when the next step begins (after a
save's staging and anything else between steps). The verdict is a world all-reduce of one
flag, so every rank stops together with the same evidence, as the other checks do. The rank
whose own state changed is the one blamed: nothing but its memory wrote it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from worker.trainer.sdc import SilentCorruption, fingerprint, state_tensors
from worker.trainer.step import Trainer


class AtRestCheck:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.sealed_step = -1
        self.seal_fp = torch.zeros(0, dtype=torch.int64)

    def _state(self) -> list[tuple[str, torch.Tensor]]:
        # rebuilt each time: an optimizer creates its state at its first step
        return state_tensors(self.trainer.parts, self.trainer.optimizers)

    def seal(self, step: int) -> None:
        """Right after the update of `step` (or the restore of it): the state as written."""
        self.sealed_step, self.seal_fp = step, fingerprint(self._state())

    def verify(self, before_copy: bool, checked_step: int | None) -> None:
        """Every rank at the same point; raises SilentCorruption on every rank when any rank's
        state changed since its seal. `before_copy`: the sealed step's snapshot and checkpoint
        are not taken yet, so the newest clean state is the step before it. `checked_step`: the
        newest step the replica check vouched for, where there is one: a rollback never goes
        past it."""
        tensors = self._state()
        now = fingerprint(tensors)
        differs = (now != self.seal_fp).nonzero() if now.shape == self.seal_fp.shape else None
        changed = None
        if differs is None:  # state tensors appeared or vanished: a structure, not a flip
            changed = "the set of state tensors"
        elif differs.numel():
            changed = tensors[int(differs[0])][0]
        device = self.trainer.ctx.device
        flag = torch.tensor([int(changed is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, {"rank": self.trainer.ctx.rank, "changed": changed})
        clean = self.sealed_step - 1 if before_copy else self.sealed_step
        if checked_step is not None:
            clean = min(clean, checked_step)
        raise SilentCorruption(evidence(self.sealed_step, clean, reports))


def evidence(step: int, clean_step: int, reports: list[dict]) -> dict:
    """RankReport.sdc's shape, from every rank's {rank, changed: the first of its state tensors
    whose fingerprint moved since the seal, or None}."""
    bad = [r for r in reports if r["changed"]]
    ranks = [r["rank"] for r in bad]
    what = "; ".join(f"rank {r['rank']}: {r['changed']}" for r in bad)
    return {
        "check": "at_rest",
        "step": step,
        "clean_step": clean_step,
        "tensor": bad[0]["changed"],
        "ranks": ranks,
        "suspects": ranks,
        "detail": (
            f"state written by the update of step {step} changed at rest before it was read "
            f"again ({what}); blamed: rank(s) {ranks}, whose own memory changed it"
        ),
    }
