"""Initial weights generated per shard: each rank computes only the elements it holds, and
each element's value is a function of (parameter seed, its index in the full tensor), so every
layout holds exactly the values one process would generate for the whole tensor.

Before, each rank generated every full parameter on its CPU from a sequential generator and
kept its slice: at 70B with pp 1 that is minutes per rank of random numbers mostly thrown away.
A sequential generator cannot skip to a shard's elements; a counter-based one can. Here each
element's two 32-bit words come from the PCG hash (Jarzynski and Olano, "Hash Functions for
GPU Rendering", JCGT 2020) of its flat index mixed with the parameter's seed, and Box-Muller in
float64 turns them into one normal value. All arithmetic is int64 on values below 2^32 times
constants below 2^30, so nothing overflows, and the result is the same on every rank.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from worker.trainer.shards import piece

_M32 = 0xFFFFFFFF
CHUNK = 1 << 22  # elements per slab: bounds the temporaries (about 50 bytes an element)


def _pcg(x: torch.Tensor) -> torch.Tensor:
    """PCG hash of 32-bit values held in int64."""
    state = (x * 747796405 + 2891336453) & _M32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _M32
    return (word >> 22) ^ word


def normal_at(seed: int, flat: torch.Tensor) -> torch.Tensor:
    """N(0, 1) in float64 for each flat index in `flat` (int64), under `seed` (< 2**63)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    lo, hi = flat & _M32, flat >> 32
    a = _pcg(_pcg(lo ^ k0) ^ hi ^ k1)
    b = _pcg(a ^ 0x9E3779B9)  # a second word: one more round of the same hash
    u = (a.double() + 0.5) / 2**32  # (0, 1): the log is finite
    v = b.double() / 2**32
    return torch.sqrt(-2 * torch.log(u)) * torch.cos(2 * math.pi * v)


def _held(p: torch.Tensor, dim: int) -> torch.Tensor:
    """The indices along `dim` of the full tensor that this rank's shard of `p` holds, in
    local order. The DTensor's own redistribution decides them (Shard, FSDP's _StridedShard),
    applied to a probe that is full-sized along `dim` only. Along the others it is the square
    of how many ways the mesh splits that dim (FSDP's _StridedShard splits a dim TP already
    split, into dp x tp pieces of each TP piece), so every rank's piece is non-empty and the
    probe stays small."""
    n = p.shape[dim]
    if not isinstance(p, DTensor):
        return torch.arange(n, device=p.device)
    splits = [1] * p.dim()
    for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
        # torch 2.13's _StridedShard is no Shard (is_shard() is False) but splits its dim too
        if placement.is_shard() or isinstance(placement, _StridedShard):
            splits[placement.dim] *= size
    shape = [n if d == dim else min(p.shape[d], splits[d] ** 2) for d in range(p.dim())]
    view = [n if d == dim else 1 for d in range(p.dim())]
    probe = torch.arange(n, device=p.device).view(view).expand(shape)
    mine = piece(probe, p.device_mesh, p.placements)
    return mine.movedim(dim, 0).reshape(mine.shape[dim], -1)[:, 0]


@torch.no_grad()
def fill_normal(p: torch.Tensor, seed: int, std: float) -> None:
    """Write N(0, std) into this rank's elements of `p` (a DTensor's local shard, or a whole
    tensor): each the value its flat index in the full tensor has under `seed`."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.numel() == 0:
        return
    held = [_held(p, d) for d in range(p.dim())]
    strides = torch.empty(p.shape, device="meta").stride()
    rest = torch.zeros((), dtype=torch.int64, device=local.device)
    for d in range(1, p.dim()):
        shape = [-1 if e == d - 1 else 1 for e in range(p.dim() - 1)]
        rest = rest + (held[d] * strides[d]).view(shape)
    rows = held[0] * strides[0]
    step = max(1, CHUNK // max(1, rest.numel()))
    for start in range(0, rows.numel(), step):
        first = rows[start : start + step].view([-1] + [1] * (p.dim() - 1))
        values = normal_at(seed, first + rest).mul_(std)
        local[start : start + step].copy_(values)  # to the parameter's dtype
