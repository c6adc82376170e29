"""Activation checkpointing (worker/trainer/activation_checkpoint.py) on one block of the model,
read through the operations its backward runs (a TorchDispatchMode sees each one, the
recomputed ones included): with no checkpointing backward recomputes nothing; with
`true` it runs the block's forward again, matmuls and all; with "selective" it runs none of
the forward's matmuls or attention again, only the cheap operations between them. The
gradients are the same bits in all three."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from services.spec import ModelSpec
from worker.trainer.activation_checkpoint import KEPT, apply_ac
from worker.trainer.model import build_model


class Counted(TorchDispatchMode):
    """How many times each kind of operation ran: the kept kinds and all the others."""

    def __init__(self):
        super().__init__()
        self.kept = self.other = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in KEPT:
            self.kept += 1
        else:
            self.other += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: bool | str) -> tuple[Counted, list[torch.Tensor]]:
    model = build_model(ModelSpec(preset="tiny"), seed=3)
    if mode:
        apply_ac(model, mode)
    block: nn.Module = model.layers["0"]
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = block(x, model.rope_cos, model.rope_sin)
    counted = Counted()
    with counted:
        out.square().sum().backward()
    return counted, [x.grad, *(p.grad for p in block.parameters())]


@pytest.fixture(scope="module")
def runs() -> dict:
    return {mode: backward_ops(mode) for mode in (False, True, "selective")}


def test_whole_block_recompute_runs_the_forward_matmuls_again(runs):
    none, full = runs[False][0], runs[True][0]
    assert full.kept > none.kept and full.other > none.other


def test_selective_recompute_runs_no_matmul_again_but_the_cheap_operations(runs):
    none, selective = runs[False][0], runs["selective"][0]
    assert selective.kept == none.kept
    assert selective.other > none.other


def test_every_mode_gives_the_same_gradient_bits(runs):
    want = runs[False][1]
    for mode in (True, "selective"):
        got = runs[mode][1]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), mode
