"""Run as 4 ranks (tests/rankrun.py: torchrun's environment): clip_grad_norm over DTensor and
plain gradients, on two layouts of the same ranks: dp2 x tp2 (one stage) and pp2 x tp2 (two
stages).

Every rank builds the same full gradients from one seed and keeps its own piece, so the
exact global norm is known. Prints one JSON line per layout on rank 0.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from worker.trainer.optim import clip_grad_norm


def full_grads(stage: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + stage)
    return {
        "sharded_2d": torch.randn(8, 6, generator=g),  # FSDP over TP: Shard on dp and on tp
        "sharded_tp": torch.randn(6, 4, generator=g),  # TP only: replicated over dp
        "sharded_dp": torch.randn(6, generator=g),  # FSDP only: replicated over tp
        "plain": torch.randn(5, generator=g),  # no DTensor: the same on every rank
        # a replicated weight whose gradient is Partial over tp (sequence-parallel norms)
        "partial_tp": torch.randn(7, generator=g),
    }


def stage_params(mesh, stage: int) -> list[torch.nn.Parameter]:
    """One stage's parameters as this rank holds them; `mesh` is the stage's (dp, tp)."""
    placements = {
        "sharded_2d": [Shard(0), Shard(1)],
        "sharded_tp": [Replicate(), Shard(1)],
        "sharded_dp": [Shard(0), Replicate()],
    }
    params = []
    for name, grad in full_grads(stage).items():
        if name == "partial_tp":  # each TP rank holds one summand: half (exact in binary)
            p = torch.nn.Parameter(
                distribute_tensor(torch.zeros_like(grad), mesh, [Replicate()] * 2)
            )
            p.grad = DTensor.from_local(grad / mesh.size(1), mesh, [Replicate(), Partial()])
        elif name in placements:
            where = placements[name]
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, where))
            p.grad = distribute_tensor(grad, mesh, where)
        else:
            p = torch.nn.Parameter(torch.zeros_like(grad))
            p.grad = grad.clone()
        params.append(p)
    return params


def check(layout: str, dp: int, pp: int, tp: int) -> dict:
    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    stage = mesh.get_coordinate()[1]
    params = stage_params(mesh["dp", "tp"], stage)
    exact = torch.cat(
        [g.double().flatten() for s in range(pp) for g in full_grads(s).values()]
    ).norm()
    norm = clip_grad_norm(params, None, dp * tp)
    max_norm = float(exact) / 2
    clipped = clip_grad_norm(params, max_norm, dp * tp)  # returns the norm before clipping
    after = clip_grad_norm(params, None, dp * tp)
    return {
        "layout": layout,
        "exact": float(exact),
        "norm": float(norm),
        "norm_device": str(norm.device),
        "clipped_reports": float(clipped),
        "after_clip": float(after),
        "max_norm": max_norm,
    }


def main() -> None:
    dist.init_process_group("gloo")
    results = [check("dp2xtp2", 2, 1, 2), check("pp2xtp2", 1, 2, 2)]
    if dist.get_rank() == 0:
        for r in results:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
