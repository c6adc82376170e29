"""The mixture-of-experts layer in one process (worker/trainer/moe.py): routing decided per
sequence (so any batch split routes alike), capacity drops, the dispatch and combine against
a per-token loop, and the balance loss reaching the router."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from services.spec import ModelSpec
from worker.trainer.moe import MoE, Router

E, K, D = 4, 2, 16


def router(capacity_factor: float = 0.0, seed: int = 0) -> Router:
    torch.manual_seed(seed)
    r = Router(D, E, K, capacity_factor)
    torch.nn.init.normal_(r.gate.weight, std=0.5)
    return r


def tokens(b: int = 6, t: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_routing_of_a_batch_is_the_routing_of_its_parts(capacity_factor):
    r, x = router(capacity_factor), tokens()
    whole = r(x)
    halves = [r(part) for part in x.split(3)]
    for field in ("chosen", "kept", "weights"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(h, field) for h in halves]))
    # the balance loss is a mean over sequences: the halves' mean is the whole's
    assert whole.balance.item() == pytest.approx(sum(h.balance.item() for h in halves) / 2)


def test_dropless_routing_keeps_every_choice():
    routing = router(0.0)(tokens())
    assert bool(routing.kept.all())
    assert torch.allclose(routing.weights.sum(-1), torch.ones(6, 10))


def test_capacity_caps_each_expert_per_sequence_first_choices_first():
    b, t = 6, 10
    r = router(1.0)
    with torch.no_grad():
        r.gate.weight[0] += 3.0  # a hot expert: most tokens choose expert 0 first
    routing = r(tokens(b, t))
    cap = math.ceil(1.0 * t * K / E)
    kept_per = F.one_hot(routing.chosen, E) * routing.kept[..., None]
    assert int(kept_per.sum((1, 2)).max()) == cap  # the hot expert is full...
    assert not bool(routing.kept.all())  # ...and choices beyond it were dropped
    for s in range(b):
        firsts = int((routing.chosen[s, :, 0] == 0).sum())
        if firsts >= cap:  # first choices alone fill it: no second choice of 0 is kept
            seconds = (routing.chosen[s, :, 1] == 0) & routing.kept[s, :, 1]
            assert not bool(seconds.any())
    assert bool((routing.weights[~routing.kept] == 0).all())  # a dropped choice adds nothing


def moe(capacity_factor: float = 0.0, aux: float = 0.0) -> MoE:
    cfg = ModelSpec(
        layers=1,
        d_model=D,
        heads=2,
        vocab=8,
        seq_len=10,
        ffn_hidden=24,
        experts=E,
        top_k=K,
        capacity_factor=capacity_factor,
        aux_loss_coef=aux,
    )
    torch.manual_seed(3)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_dispatch_and_combine_equal_a_per_token_loop(capacity_factor):
    layer, x = moe(capacity_factor), tokens()
    got = layer(x)
    routing = layer.router(x)
    ex = layer.experts
    want = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for j in range(K):
                e = int(routing.chosen[b, t, j])
                h = F.silu(x[b, t] @ ex.w_gate[e]) * (x[b, t] @ ex.w_up[e])
                want[b, t] += routing.weights[b, t, j] * (h @ ex.w_down[e])
    assert torch.allclose(got, want, atol=1e-5)


def test_the_balance_loss_reaches_the_router_through_the_output():
    x = tokens()
    grads = []
    for aux in (0.0, 0.5):
        layer = moe(aux=aux)
        layer(x).sum().backward()
        grads.append(layer.router.gate.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])  # the aux loss added a router gradient


def test_load_stats_count_one_step_of_forwards():
    layer = moe(capacity_factor=1.0)
    layer.stats.per_step = 2
    x = tokens()
    for _ in range(3):  # one forward more than a step has, as a pipeline's first step runs
        layer(x)
    counts = layer.stats.take()
    routed = 2 * x.shape[0] * x.shape[1] * K
    assert counts[:E].sum().item() + counts[E].item() == routed  # kept + dropped
    assert counts[E].item() > 0
    assert layer.stats.take() is None  # taken
