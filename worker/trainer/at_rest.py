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
- before the step's snapshot and checkpoint copy it, where the verdict is a world all-reduce
  of one flag, so every rank stops together with the same evidence, as the other checks do,
  and no copy of a corrupted state is ever taken;
- when the next step begins (after the copies, a save's staging, anything else between
  steps), alone: the rank that finds its state moved raises by itself, and its peers fail in
  the step's first collective with it gone. A second collective every step would cost more
  than this rare case saves (measured on CPU: a few ms a step on a loaded host).
The rank whose own state changed is the one blamed: nothing but its memory wrote it.
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

    def _changed(self) -> str | None:
        """The first state tensor whose fingerprint moved since the seal; None: none did."""
        tensors = self._state()
        now = fingerprint(tensors)
        if now.shape != self.seal_fp.shape:  # tensors appeared or vanished: not a flip
            return "the set of state tensors"
        differs = (now != self.seal_fp).nonzero()
        return tensors[int(differs[0])][0] if differs.numel() else None

    def _clean(self, before_copy: bool, checked_step: int | None) -> int:
        """The newest clean step: before the sealed step's copies were taken, the step before
        it; after them, the sealed step (its copies were verified). Never past the replica
        check's newest checked step, where there is one."""
        clean = self.sealed_step - 1 if before_copy else self.sealed_step
        return clean if checked_step is None else min(clean, checked_step)

    def verify(self, checked_step: int | None) -> None:
        """Every rank, before the sealed step's copies are taken: raises SilentCorruption on
        every rank, with the same evidence, when any rank's state changed since its seal.
        `checked_step`: the replica check's newest checked step, where it runs."""
        changed = self._changed()
        flag = torch.tensor([int(changed is not None)], device=self.trainer.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, {"rank": self.trainer.ctx.rank, "changed": changed})
        clean = self._clean(before_copy=True, checked_step=checked_step)
        raise SilentCorruption(evidence(self.sealed_step, clean, reports))

    def verify_here(self, checked_step: int | None) -> None:
        """This rank alone, before the next step reads the state: raises SilentCorruption
        when its own state changed since the seal."""
        changed = self._changed()
        if changed is not None:
            report = {"rank": self.trainer.ctx.rank, "changed": changed}
            clean = self._clean(before_copy=False, checked_step=checked_step)
            raise SilentCorruption(evidence(self.sealed_step, clean, [report]), alone=True)


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
