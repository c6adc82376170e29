"""Restore a new generation from the old one's in-memory snapshots (docs/architecture.md,
"Hot recovery").

The controller says where each rank's state lives (`plan.sources`: the rank itself, whose
worker ran it, or the rank whose worker holds its buddy copy); the ranks decide which step,
together, through the generation's rendezvous store:
1. each rank posts the steps it can restore for every state it sources (a step restores
   from a chain of slots, worker/snapshots.py `chains`);
2. the step is the newest one every rank's state has. None, or an older one than the
   newest disk checkpoint: every rank restores from disk instead (the same decision on
   every rank, from the same posts);
3. holders offer moved ranks the chain's slots over the world group (gloo), then an empty
   offer that ends it: a moved rank on the holder's host reads the holder's files in place,
   one on another host gets the bytes sent; the others map their own slots. Every rank
   loads its chain: the whole snapshot, then the logged steps replayed. No storage is read.
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

from worker.snapshots import Slot, SnapshotPlan, chains, complete_slots, encode_manifest
from worker.trainer.distributed import rendezvous_store
from worker.trainer.snapshot_state import load_chain
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
    replayed: int  # logged steps replayed after the whole snapshot (worker/snapshots.py)


def _slots(plan: SnapshotPlan, rank: int) -> dict[int, dict[int, list[Slot]]]:
    """For every state this rank sources: step -> the chain of complete slots restoring it."""
    g = plan.restore_generation
    out = {}
    for state, source in (plan.sources or {}).items():
        if source == rank:
            # this worker's copy of a state: its own snapshot if it ran the rank, the held copy
            # if it was the rank's buddy (a rank moved onto its own buddy finds it there)
            out[state] = chains(
                {
                    **complete_slots(plan.held_dir(state, g), g),
                    **complete_slots(plan.own_dir(state, g), g),
                }
            )
    return out


def check_chain(manifests: list[dict], rank: int, step: int) -> None:
    """Raise RuntimeError unless `manifests` restore `rank` at `step`: its slots, a whole
    snapshot first, each next one logged on the one before, the last at `step`."""
    chain = chains({m["step"]: Slot(Path(), m) for m in manifests}).get(step, [])
    if not (len(chain) == len(manifests) > 0 and all(m["rank"] == rank for m in manifests)):
        got = [(m.get("rank"), m.get("step"), m.get("kind")) for m in manifests]
        raise RuntimeError(f"snapshot for rank {rank} step {step}: the slots sent are {got}")


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
    # next: offers (each chain's slots, then an empty offer), answers, images
    mine = _slots(plan, rank)
    serve = {state: chain[step] for state, chain in mine.items() if state != rank}
    sends = []
    for state, slots in serve.items():
        for slot in slots:
            raw, n = encode_manifest(slot.manifest), slot.manifest["nbytes"]
            sends += isend_offer(raw, n, slot.bin, state)
        sends += isend_offer(None, 0, None, state)
    source = plan.sources[rank]
    if source == rank:
        own = mine[rank][step]
        chain = [(s.manifest, _map(s.bin, s.manifest["nbytes"])) for s in own]
        via = "own"
    else:
        offers = list(iter(lambda: recv_offer(source), None))
        if not offers:
            raise RuntimeError(f"rank {source} offered no snapshot though the world agreed on one")
        via = "memory" if all(o.visible() for o in offers) else "network"
        for _ in offers:
            sends += isend_answer(via == "network", source)
    for state, slots in serve.items():
        for slot in slots:
            if recv_answer(state):
                n = slot.manifest["nbytes"]
                sends += isend_image(_map(slot.bin, n), n, state)
    if via == "memory":  # the holder's files, read in place: no copy
        chain = [(o.manifest, _map(o.path, o.nbytes)) for o in offers]
    elif via == "network":
        chain = []
        for o in offers:
            image = torch.empty(o.nbytes, dtype=torch.uint8)
            dist.recv(image, source)
            chain.append((o.manifest, image))
    check_chain([m for m, _ in chain], rank, step)
    saved = load_chain(model_parts, optimizers, lr_schedulers, chain)
    data.check_resume(saved)
    for s in sends:
        s.wait()
    source_kind = "memory" if source == rank else "peer"
    return MemoryRestore(step, source_kind, time.perf_counter() - t0, via, len(chain) - 1)
