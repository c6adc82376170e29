"""A tied embedding and LM head under a pipeline: two copies of one weight, kept equal.

Stage 0 holds the token embedding and the last stage a copy of it as its head
(worker/trainer/pipeline.py). The copies start equal: one parameter name, so the seeded init
writes the same values into both and a restore reads the same checkpoint tensor into both
(DCP saves a name two ranks hold once). They stay equal: after backward each holds the
gradient of its own use, and one all-reduce between the two ranks that hold the copies (the
same coordinates on every other axis, pipeline ranks 0 and pp - 1) sums them. Both then take
the same optimizer step from the gradient one process computes for its single tensor, which
is how Megatron keeps its shared embedding (its "embedding group"). The gradient norm counts
the two copies as one tensor (`clip_grad_norm`'s `stage_copies`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from worker.trainer.optim import laid_out_like


@dataclass(frozen=True)
class TiedCopies:
    """This rank's copies (its first or last stage's embedding weight) and the group of the
    two ranks that hold them."""

    params: tuple[nn.Parameter, ...]
    group: dist.ProcessGroup

    @classmethod
    def of(cls, parts: Sequence[nn.Module], mesh: DeviceMesh) -> TiedCopies | None:
        """Every rank forms every pair's group, in one order (gloo connects only the two
        members; the trainer gives it the others' timeout, `hold_timeouts`); None on a rank
        that holds no copy (a middle stage) or when nothing is tied across stages."""
        names = list(mesh.mesh_dim_names or ())
        pp = mesh.size(names.index("pp"))
        if pp == 1 or not getattr(parts[0], "tied", False):
            return None
        lines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp).tolist()
        me, mine = dist.get_rank(), None
        for line in lines:
            pair = [line[0], line[-1]]
            group = dist.new_group(pair)
            if me in pair:
                mine = group
        held = tuple(part.embed.weight for part in parts if part.embed is not None)
        return cls(held, mine) if mine is not None and held else None

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum of both uses' gradients (after the step's
        backward and its data-parallel reduction: the two copies' shards are laid out alike)."""
        for p in self.params:
            p.grad = laid_out_like(p.grad, p)  # a whole or Partial gradient is no shard yet
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=self.group)
