"""Gradient clipping (worker/trainer/optim.py): the exact global norm, computed without a
host sync, and the clip it applies."""

import json

import pytest
import torch

from tests.launch import run_ranks
from worker.trainer.optim import clip_grad_norm


def params_with_grads(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_norm_is_the_norm_of_all_gradients_as_one_vector():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 3, generator=g), torch.randn(11, generator=g)]
    norm = clip_grad_norm(params_with_grads(*grads), None, 1)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0  # the caller syncs, not this
    want = torch.cat([t.double().flatten() for t in grads]).norm()
    assert float(norm) == pytest.approx(float(want), rel=1e-6)


def test_gradients_under_the_limit_are_left_bit_for_bit():
    grads = [torch.full((4,), 0.1), torch.full((3, 2), -0.2)]
    params = params_with_grads(*grads)
    clip_grad_norm(params, 10.0, 1)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g)


def test_gradients_over_the_limit_are_scaled_to_it():
    params = params_with_grads(torch.tensor([3.0, 0.0]), torch.tensor([4.0]))  # norm 5
    assert float(clip_grad_norm(params, 1.0, 1)) == pytest.approx(5.0)
    assert params[0].grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5)
    assert params[1].grad.tolist() == pytest.approx([0.8], rel=1e-5)


@pytest.fixture(scope="module")
def distributed_results() -> dict[str, dict]:
    proc = run_ranks(4, "tests.unit.grad_norm_check", timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["layout"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2xtp2", "pp2xtp2"])
def test_dtensor_pieces_across_ranks_give_the_exact_global_norm(distributed_results, layout):
    r = distributed_results[layout]
    assert r["norm"] == pytest.approx(r["exact"], rel=1e-6), r
    assert r["clipped_reports"] == pytest.approx(r["exact"], rel=1e-6), r
    assert r["after_clip"] == pytest.approx(r["max_norm"], rel=1e-5), r
