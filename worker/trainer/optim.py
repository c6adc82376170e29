"""AdamW, warmup + cosine schedule, and gradient clipping over the whole mesh."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from services.spec import TrainSpec


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW whose fused kernel runs on each parameter's local piece. The update is
    elementwise, so a DTensor's local shard (or replica) updated alone gives exactly what
    DTensor's dispatch of the same kernel gives, without that dispatch: its sharding
    propagation over every parameter, uncached in a fresh process, was about 60 ms of the
    first step after a recovery on the small preset, and it refuses a list that mixes DTensor
    and plain parameters (TP without FSDP). The state stays DTensor-shaped like its parameter
    (the local tensors are the same storage), so checkpoints and snapshots do not change."""

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps):
        # torch 2.13's Adam: fills the lists (creating state on the first step), then the
        # functional update runs on them; only the lists' elements are swapped for local views
        has_complex = super()._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        )
        # DTensor's dispatch would redistribute a gradient laid out unlike its parameter;
        # clip_grad_norm, which every step runs first, already has (laid_out_like)
        for g, p in zip(grads, params, strict=True):
            if isinstance(g, DTensor) and g.placements != p.placements:
                raise RuntimeError(
                    f"gradient laid out as {g.placements}, its parameter as {p.placements}: "
                    "run clip_grad_norm (which lays gradients out like their parameters) first"
                )
        for tensors in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            tensors[:] = [_local(t) for t in tensors]
        return has_complex


def laid_out_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` in its parameter's layout. Under TP with sequence parallelism the norms'
    weights are replicated but their gradients come back Partial (one summand per TP rank),
    and a vocab-sharded embedding's gradient comes back whole: a Partial is all-reduced, a
    whole one sliced."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(grad.device_mesh, param.placements)
    return grad


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # to_local() without autograd


def build_optimizer(params: list[torch.nn.Parameter], t: TrainSpec) -> torch.optim.AdamW:
    """AdamW, fused: one kernel per step for every parameter (CPU and CUDA alike), on local
    pieces (`ShardLocalAdamW`). The foreach form runs a dozen list ops per step."""
    return ShardLocalAdamW(
        params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, eps=1e-8, fused=True
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
    params: list[torch.nn.Parameter],
    max_norm: float | None,
    stage_ranks: int,
    stage_copies: Sequence[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Global L2 norm over every rank (DP shards, TP shards, PP stages), clipping to `max_norm`
    when it is set; a 0-dim float64 tensor on the gradients' device.

    Each rank adds its local squares divided by the number of ranks holding the same piece,
    so replicated pieces count once, and one all-reduce sums them. `stage_copies`: this
    rank's parameters that another pipeline stage holds a copy of, with the same gradient (a
    tied head's embedding, worker/trainer/tied_copies.py): two stages' worth of copies.
    Nothing here waits for the device: one foreach norm over the local pieces, the clip
    coefficient stays a tensor (clamped to 1, as torch.nn.utils.clip_grads_with_norm_ does),
    and the caller reads the norm on the host once, together with the loss.
    """
    for p in params:  # local pieces of a Partial gradient are summands, not the gradient
        if p.grad is not None:
            p.grad = laid_out_like(p.grad, p)
    grads = [p.grad for p in params if p.grad is not None]
    pieces = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = pieces[0].device if pieces else torch.device("cpu")
    norms = torch._foreach_norm(pieces, 2, dtype=torch.float32) if pieces else []
    copied = {id(p.grad) for p in stage_copies}
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g, norm in zip(grads, norms, strict=True):
        stages = 2 if id(g) in copied else 1
        by_copies.setdefault(stages * _copies(g, stage_ranks), []).append(norm)
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
