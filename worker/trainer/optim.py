"""AdamW, warmup + cosine schedule, and gradient clipping over the whole mesh."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from services.spec import TrainSpec


def build_optimizer(params: list[torch.nn.Parameter], t: TrainSpec) -> torch.optim.AdamW:
    """AdamW, fused: one kernel per step for every parameter (CPU and CUDA alike). The foreach
    form runs a dozen list ops, and on DTensor parameters (FSDP2, TP) each pays DTensor's
    dispatch over every parameter: at dp2 on CPU that made the update twice plain DDP's.
    Foreach stays where DTensor and plain parameters mix (TP without FSDP, vocab or sequence
    parallelism off): the fused kernel's DTensor dispatch refuses such a list."""
    mixed = len({isinstance(p, DTensor) for p in params}) > 1
    return torch.optim.AdamW(
        params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, eps=1e-8, fused=not mixed
    )


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
) -> torch.Tensor:
    """Global L2 norm over every rank (DP shards, TP shards, PP stages), clipping to `max_norm`
    when it is set; a 0-dim float64 tensor on the gradients' device.

    Each rank adds its local squares divided by the number of ranks holding the same piece,
    so replicated pieces count once, and one all-reduce sums them. Nothing here waits for the
    device: one foreach norm over the local pieces, the clip coefficient stays a tensor
    (clamped to 1, as torch.nn.utils.clip_grads_with_norm_ does), and the caller reads the
    norm on the host once, together with the loss.
    """
    grads = [p.grad for p in params if p.grad is not None]
    pieces = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = pieces[0].device if pieces else torch.device("cpu")
    norms = torch._foreach_norm(pieces, 2, dtype=torch.float32) if pieces else []
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g, norm in zip(grads, norms, strict=True):
        by_copies.setdefault(_copies(g, stage_ranks), []).append(norm)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for copies, group in by_copies.items():
        squares += torch.stack(group).double().square().sum() / copies
    if dist.is_initialized():
        dist.all_reduce(squares)
    norm = squares.sqrt()
    if max_norm is not None and pieces:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)
        torch._foreach_mul_(pieces, coef)
    return norm
