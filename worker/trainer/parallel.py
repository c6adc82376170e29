"""The parallel layout of one trainer: degrees, the DeviceMesh, and the apply_* helpers.

Concessions, each on purpose:
- TP splits attention by heads (q/k/v column-wise, o row-wise) and the MLP (gate/up
  column-wise, down row-wise). Embedding, final norm and LM head stay replicated across
  TP: at the sizes tests and the demo run, vocab-parallel loss would cost more in
  collectives than it saves, and replicated norms need no sequence parallelism.
- `zero` levels map onto FSDP2 exactly:
    0  replicate: full parameters, gradients and optimizer state on every DP rank;
       gradients all-reduced (FSDP2-based `replicate`, i.e. DDP semantics).
    2  shard gradients + optimizer state: `fully_shard(reshard_after_forward=False)`;
       parameters stay gathered between forward and backward (ZeRO-2).
    3  full shard: parameters re-sharded after forward, gathered again for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from services.mesh import AXES, Coord, MeshShape
from services.spec import ParallelSpec


@dataclass(frozen=True)
class ParallelDims:
    spec: ParallelSpec
    device_type: str

    @property
    def shape(self) -> MeshShape:
        return MeshShape(self.spec.dp, self.spec.pp, self.spec.tp)

    def build_mesh(self) -> DeviceMesh:
        s = self.spec
        return init_device_mesh(self.device_type, (s.dp, s.pp, s.tp), mesh_dim_names=AXES)


@dataclass(frozen=True)
class RankContext:
    """Everything a rank needs to know about where it sits; passed explicitly."""

    dims: ParallelDims
    mesh: DeviceMesh
    rank: int
    device: torch.device

    @property
    def coord(self) -> Coord:
        return self.dims.shape.coord(self.rank)

    @property
    def is_last_stage_leader(self) -> bool:
        """One rank per DP replica that owns the loss value (last stage, tp 0)."""
        c = self.coord
        return c.pp == self.dims.spec.pp - 1 and c.tp == 0


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def apply_ac(model: nn.Module) -> None:
    """Recompute each block's activations in backward: memory for compute, same numerics."""
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero: int) -> None:
    """Shard each block, then the remainder (embedding, norm, head) as the root group."""
    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in model.layers.values():
            replicate(block, mesh=dp_mesh)
        replicate(model, mesh=dp_mesh)
        return
    from torch.distributed.fsdp import fully_shard

    reshard = zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
