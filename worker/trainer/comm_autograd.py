"""Collectives as autograd functions, for the mixture-of-experts layer (worker/trainer/moe.py).

Where a layer computes by hand what DTensor would compute for a plain linear layer, the
forward and the backward of each exchange are stated here, Megatron's way:
- `copy_to(x, group)`: identity forward; backward sums the gradient over the group. Every rank
  of a TP group computes from the same (replicated) input with its own weight shard, so each
  holds a partial sum of the input's gradient.
- `reduce_from(x, group)`: forward sums partial results over the group; backward is the
  identity, since every rank then receives the same (replicated) gradient.
- `scale_grad(x, factor)`: identity forward; backward multiplies the gradient by `factor`.
- `all_to_all(x, send, receive, group)`: rows to each peer by split sizes; backward sends the
  gradient rows back the same way (torch's functional all-to-all with autograd).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def copy_to(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFrom.apply(x, group)


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    return _ScaleGrad.apply(x, factor)


def all_to_all(
    x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows of `x`: the first send[0] to peer 0, the next send[1] to peer 1, ...; returns the
    rows received, receive[i] of them from peer i, in peer order."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), receive, send, group)
    return funcol.wait_tensor(out)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal slices of `counts` to each peer (not differentiable): peer i gets slice i."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group)
    return out
