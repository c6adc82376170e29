"""The mixture-of-experts layer on a real GPU (worker/trainer/moe.py, grouped_gemm.py): in bf16
on sm90 or newer, a dropless layer's forward and backward never synchronise with the host
(torch's sync debug mode turns any synchronisation into an error), and its grouped GEMM against
an expert-by-expert loop at a Mixtral-like width, both timed for `make gpu-check`'s summary."""

from __future__ import annotations

import pytest
import torch

from services.spec import ModelSpec
from worker.trainer import grouped_gemm
from worker.trainer.moe import MoE

pytestmark = pytest.mark.gpu

TOKENS, D, HIDDEN, EXPERTS = 8192, 2048, 5632, 8


def layer(device: torch.device) -> MoE:
    cfg = ModelSpec(
        layers=1, d_model=D, heads=16, vocab=8, seq_len=1024, ffn_hidden=HIDDEN, experts=EXPERTS
    )
    torch.manual_seed(0)
    moe = MoE(cfg).to(device, torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe


def step_ms(moe: MoE, x: torch.Tensor, repeats: int = 10) -> float:
    """Median milliseconds of a forward and backward."""
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        moe(x).float().square().mean().backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[2:])[repeats // 2]


def test_a_dropless_bf16_layer_never_syncs_and_its_grouped_gemm_is_timed(measured, monkeypatch):
    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("torch's grouped GEMM kernel needs sm90 or newer; older GPUs loop on the host")
    moe = layer(device)
    x = torch.randn(TOKENS // 1024, 1024, D, device=device, dtype=torch.bfloat16)
    moe(x).float().square().mean().backward()  # warm-up: cuBLAS and CUTLASS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grouped = step_ms(moe, x)
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM", None)  # the expert-by-expert loop
    looped = step_ms(moe, x)
    measured(
        "moe_grouped_gemm",
        {"grouped_ms": round(grouped, 2), "per_expert_ms": round(looped, 2), "tokens": TOKENS},
    )
