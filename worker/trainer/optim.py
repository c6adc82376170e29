"""AdamW, warmup + cosine schedule, and gradient clipping over the whole mesh."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from services.spec import TrainSpec


def build_optimizer(params: list[torch.nn.Parameter], t: TrainSpec) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, eps=1e-8)


def lr_factor(step: int, t: TrainSpec) -> float:
    """Linear warmup to lr, then cosine down to min_lr_ratio * lr at the last step."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, t: TrainSpec) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, t))


def _copies(grad: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks of a pipeline stage hold this exact gradient piece."""
    if not isinstance(grad, DTensor):
        return stage_ranks
    shards = 1
    for i, placement in enumerate(grad.placements):
        if not placement.is_replicate():  # Shard and _StridedShard (FSDP over TP) alike
            shards *= grad.device_mesh.size(i)
    return stage_ranks // shards


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float | None, stage_ranks: int
) -> float:
    """Global L2 norm over every rank (DP shards, TP shards, PP stages) in one all-reduce.

    Each rank adds its local squares divided by the number of ranks holding the same
    piece, so replicated pieces count once. Clips when `max_norm` is set.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.zeros((), dtype=torch.float64)
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        local += t.double().square().sum().cpu() / _copies(g, stage_ranks)
    if dist.is_initialized():
        dist.all_reduce(local)
    norm = float(local.sqrt())
    if max_norm is not None and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm
