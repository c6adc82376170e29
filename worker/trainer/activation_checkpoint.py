"""Activation checkpointing (`parallel.activation_checkpointing`): each block's activations
recomputed in backward instead of held from forward, with the same numerics.

- true: the whole block again, from its input (the least memory).
- "selective": torchtitan's op-level SAC. The block runs under torch's selective checkpoint
  contexts, whose policy keeps the output of every matmul, attention kernel and TP collective
  (the operations that cost compute or communication to redo) and recomputes the rest: the
  RMSNorms, RoPE, SiLU and the products between them, memory-bound operations a few percent
  of the block's time. About half a block's activations are kept (services/planner/memory.py
  `selective_activations` counts them for the planner).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten
# on every device: the matmuls (nn.Linear reaches mm or addmm, batched experts bmm), every
# fused attention kernel SDPA may pick, and the functional collectives DTensor runs for TP
KEPT = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: bool | str) -> None:
    """Wrap each block for `mode` (true or "selective"); RNG state is not preserved: the
    blocks draw no random numbers (no dropout)."""
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy)
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
