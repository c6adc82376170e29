"""A rank's piece of a full tensor, as a DTensor layout places it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate


def piece(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's part of `full` under `placements` on `mesh`: redistributing a replicated
    DTensor to them (TP's Shard, FSDP's Shard or _StridedShard over TP) only slices locally,
    with no communication."""
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, placements).to_local()


def local_shard(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` as laid out in `p` (all of it for a plain tensor)."""
    if not isinstance(p, DTensor):
        return full
    return piece(full, p.device_mesh, p.placements)
