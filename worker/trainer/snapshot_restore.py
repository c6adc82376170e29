"""Restore a new generation from the old one's in-memory snapshots (docs/architecture.md,
"Hot recovery").

The controller says where each rank's state lives (`plan.sources`: the rank itself, whose
worker ran it, or the rank whose worker holds its buddy copy); the ranks decide which step,
together, through the generation's rendezvous store:
1. each rank posts the steps it has complete for every state it sources;
2. the step is the newest one every rank's state has. None, or an older one than the
   newest disk checkpoint: every rank restores from disk instead (the same decision on
   every rank, from the same posts);
3. holders send moved ranks their slot over the world group (gloo), the others map their
   own slot; every rank loads its image. No storage is read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from worker.snapshots import Slot, SnapshotPlan, complete_slots
from worker.trainer.distributed import rendezvous_store
from worker.trainer.snapshot_state import load
from worker.trainer.snapshot_wire import isend_slot, recv_manifest
from worker.trainer.train_state import DataStream

AGREE_TIMEOUT_S = 120.0  # every rank lists a few files: far below any restore from disk


@dataclass(frozen=True)
class MemoryRestore:
    step: int
    source: str  # memory (this worker's own snapshot) | peer (the holder's copy)
    restore_s: float


def _slots(plan: SnapshotPlan, rank: int) -> dict[int, dict[int, Slot]]:
    """For every state this rank sources: step -> complete slot."""
    g = plan.restore_generation
    out = {}
    for state, source in (plan.sources or {}).items():
        if source == rank:
            # this worker's copy of a state: its own snapshot if it ran the rank, the held copy
            # if it was the rank's buddy (a rank moved onto its own buddy finds it there)
            out[state] = {
                **complete_slots(plan.held_dir(state, g), g),
                **complete_slots(plan.own_dir(state, g), g),
            }
    return out


def agree_step(plan: SnapshotPlan, rank: int, world: int, disk_step: int | None) -> int | None:
    """The step every rank will restore from memory, or None (all restore from disk)."""
    mine = _slots(plan, rank)
    kv = rendezvous_store(f"meshkeeper/snapshot-restore/g{plan.generation}")
    for state, slots in mine.items():
        kv.set(str(state), json.dumps(sorted(slots)))
    keys = [str(r) for r in range(world)]
    kv.wait(keys, timedelta(seconds=AGREE_TIMEOUT_S))
    common = set.intersection(*(set(json.loads(kv.get(k))) for k in keys))
    step = max(common, default=None)
    if step is None or (disk_step is not None and disk_step > step):
        return None
    return step


def _map(slot: Slot) -> torch.Tensor:
    n = slot.manifest["nbytes"]
    return torch.from_file(str(slot.bin), shared=False, size=n, dtype=torch.uint8)


def _receive(src: int) -> tuple[dict, torch.Tensor]:
    got = recv_manifest(src)
    if got is None:
        raise RuntimeError(f"rank {src} sent no snapshot though the world agreed on one")
    manifest, n = got
    image = torch.empty(n, dtype=torch.uint8)
    dist.recv(image, src)
    return manifest, image


def restore_from_memory(
    plan: SnapshotPlan,
    rank: int,
    world: int,
    *,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    lr_schedulers: list[LRScheduler],
    data: DataStream,
    disk_step: int | None,
) -> MemoryRestore | None:
    """Load the agreed step's state; None when the world restores from disk."""
    if plan.sources is None or plan.restore_generation is None:
        return None
    t0 = time.perf_counter()
    step = agree_step(plan, rank, world, disk_step)
    if step is None:
        return None
    mine = _slots(plan, rank)
    sends = [
        w
        for state, slots in mine.items()
        if state != rank
        for w in isend_slot(slots[step].manifest, _map(slots[step]), state)
    ]
    source = plan.sources[rank]
    if source == rank:
        manifest, image = mine[rank][step].manifest, _map(mine[rank][step])
    else:
        manifest, image = _receive(source)
    if manifest["step"] != step or manifest["rank"] != rank:
        raise RuntimeError(
            f"snapshot for rank {rank} step {step} holds rank {manifest['rank']} "
            f"step {manifest['step']}"
        )
    saved = load(model_parts, optimizers, lr_schedulers, manifest, image)
    data.check_resume(saved)
    for s in sends:
        s.wait()
    return MemoryRestore(step, "memory" if source == rank else "peer", time.perf_counter() - t0)
