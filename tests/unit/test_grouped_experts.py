"""The experts' grouped GEMM (worker/trainer/grouped_gemm.py) against torch's own per-expert
matrix products, its fallback for widths torch's kernel refuses, and a dropless MoE layer that
never waits for the host: no `nonzero`, no `item`, no `tolist`, forward or backward (the
syncs a GPU pays per layer; issue 45)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from services.spec import ModelSpec
from worker.trainer import grouped_gemm
from worker.trainer.moe import Experts, MoE

E, D = 4, 16


def experts(hidden: int) -> Experts:
    torch.manual_seed(0)
    ex = Experts(E, D, hidden)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return ex


def per_expert(ex: Experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The oracle: torch's matmul, one expert at a time."""
    out = []
    for e, rows in enumerate(x.split(counts)):
        out.append((F.silu(rows @ ex.w_gate[e]) * (rows @ ex.w_up[e])) @ ex.w_down[e])
    return torch.cat(out)


def forward_backward(fn, ex: Experts, x: torch.Tensor) -> list[torch.Tensor]:
    ex.zero_grad()
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)))
    return [y.detach(), x.grad, *(p.grad for p in ex.parameters())]


@pytest.mark.parametrize("counts", [[3, 0, 7, 2], [0, 0, 0, 0], [12, 0, 0, 0]])
def test_one_grouped_gemm_equals_torch_per_expert_matmuls(counts):
    ex = experts(hidden=24)
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1))
    assert grouped_gemm.takes(x, ex.w_gate, ex.w_up, ex.w_down)
    got = forward_backward(lambda x: ex(x, torch.tensor(counts)), ex, x)
    want = forward_backward(lambda x: per_expert(ex, x, counts), ex, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_a_width_the_grouped_kernel_refuses_is_computed_expert_by_expert():
    ex = experts(hidden=6)  # 24-byte rows in fp32: not a multiple of 16
    assert not grouped_gemm.takes(ex.w_gate)
    counts = [2, 5, 0, 3]
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(2))
    got = forward_backward(lambda x: ex(x, torch.tensor(counts)), ex, x)
    want = forward_backward(lambda x: per_expert(ex, x, counts), ex, x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


class HostReads(TorchDispatchMode):
    """Counts the operators that read a tensor's values on the host: on a GPU each is a
    device synchronisation."""

    SYNCING = ("aten.nonzero", "aten._local_scalar_dense", "aten.masked_select")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in self.SYNCING:
            self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def host_reads(layer: MoE, monkeypatch) -> list[str]:
    """The host reads of one forward and backward of `layer`, operators and Python's
    `tolist`/`item` alike (a CPU tensor's `tolist` reaches no operator)."""
    mode = HostReads()
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)

        def counted(t, *a, _real=real, _name=name, **kw):
            mode.seen.append(_name)
            return _real(t, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    x = torch.randn(6, 10, D, generator=torch.Generator().manual_seed(3))
    with mode:
        layer(x).sum().backward()
    monkeypatch.undo()
    return mode.seen


def layer(capacity_factor: float) -> MoE:
    cfg = ModelSpec(
        layers=1, d_model=D, heads=2, vocab=8, seq_len=10, ffn_hidden=24, experts=E, top_k=2
    )
    torch.manual_seed(3)
    moe = MoE(cfg.model_copy(update={"capacity_factor": capacity_factor}))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def test_a_dropless_layer_reads_nothing_on_the_host_and_capacity_reads_one_count(monkeypatch):
    assert host_reads(layer(0.0), monkeypatch) == []
    # a capacity factor makes the kept rows' count data: one read, in the forward
    assert host_reads(layer(1.0), monkeypatch) == ["aten.nonzero"]
