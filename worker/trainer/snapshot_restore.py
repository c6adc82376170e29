"""Restore a new generation from the old one's in-memory snapshots (docs/architecture.md,
"Hot recovery").

The controller says where each rank's state lives (`plan.sources`: the rank itself, whose
worker ran it, or the rank whose worker holds its buddy copy); the ranks decide which step,
together, through the generation's rendezvous store:
1. each rank posts the steps it has complete for every state it sources;
2. the step is the newest one every rank's state has. None, or an older one than the
   newest disk checkpoint: every rank restores from disk instead (the same decision on
   every rank, from the same posts);
3. holders offer moved ranks their slot over the world group (gloo): a moved rank on the
   holder's host reads the holder's file in place, one on another host gets the bytes sent;
   the others map their own slot. Every rank loads its image. No storage is read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from worker.snapshots import Slot, SnapshotPlan, complete_slots, encode_manifest
from worker.trainer.distributed import rendezvous_store
from worker.trainer.snapshot_state import load
from worker.trainer.snapshot_wire import (
    isend_answer,
    isend_image,
    isend_offer,
    recv_answer,
    recv_offer,
)
from worker.trainer.train_state import DataStream

AGREE_TIMEOUT_S = 120.0  # every rank lists a few files: far below any restore from disk


@dataclass(frozen=True)
class MemoryRestore:
    step: int
    source: str  # memory (this worker's own snapshot) | peer (the holder's copy)
    restore_s: float
    # how the bytes came: own (this worker's file), memory (the holder's file, on this host),
    # network (sent by the holder from another host)
    via: str


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


def _map(path: Path, nbytes: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)


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
    # the phases of worker/trainer/snapshot_wire.py, each posted before any rank waits on the
    # next: offers, answers, images
    mine = _slots(plan, rank)
    serve = {state: slots[step] for state, slots in mine.items() if state != rank}
    sends = [
        w
        for state, slot in serve.items()
        for w in isend_offer(
            encode_manifest(slot.manifest), slot.manifest["nbytes"], slot.bin, state
        )
    ]
    source = plan.sources[rank]
    if source == rank:
        own = mine[rank][step]
        manifest, image, via = own.manifest, _map(own.bin, own.manifest["nbytes"]), "own"
    else:
        offer = recv_offer(source)
        if offer is None:
            raise RuntimeError(f"rank {source} offered no snapshot though the world agreed on one")
        manifest, via = offer.manifest, "memory" if offer.visible() else "network"
        sends += isend_answer(via == "network", source)
    for state, slot in serve.items():
        if recv_answer(state):
            n = slot.manifest["nbytes"]
            sends += isend_image(_map(slot.bin, n), n, state)
    if via == "memory":  # the holder's file, read in place: no copy
        image = _map(offer.path, offer.nbytes)
    elif via == "network":
        image = torch.empty(offer.nbytes, dtype=torch.uint8)
        dist.recv(image, source)
    if manifest["step"] != step or manifest["rank"] != rank:
        raise RuntimeError(
            f"snapshot for rank {rank} step {step} holds rank {manifest['rank']} "
            f"step {manifest['step']}"
        )
    saved = load(model_parts, optimizers, lr_schedulers, manifest, image)
    data.check_resume(saved)
    for s in sends:
        s.wait()
    return MemoryRestore(
        step, "memory" if source == rank else "peer", time.perf_counter() - t0, via
    )
