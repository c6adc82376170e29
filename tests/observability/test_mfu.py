"""The agent's torch-free FLOP count (worker/mfu.py) equals the model's own, which counts the
parameters of a real (meta-device) model, for every preset and an explicit shape; and the
peak it divides by is the device's at the job's precision."""

from __future__ import annotations

import json

import pytest

from services.planner.hardware import H100_80GB
from services.spec import PRESETS, ModelSpec
from worker import mfu
from worker.agent.metrics_endpoint import AgentMetrics, _AgentCollector
from worker.trainer import model

EXPLICIT = {"layers": 3, "d_model": 96, "heads": 6, "vocab": 500, "seq_len": 40}
SHAPES = [{"preset": p} for p in PRESETS] + [
    {**EXPLICIT, "ffn_hidden": 200},
    # grouped-query attention, Qwen2's biases, Qwen3's head_dim and q/k norms, a tied head
    {**EXPLICIT, "kv_heads": 2, "qkv_bias": True, "tie_embeddings": True},
    {**EXPLICIT, "kv_heads": 3, "head_dim": 32, "qk_norm": True},
]


@pytest.mark.parametrize(
    "shape",
    SHAPES,
    ids=["tiny", "small", "1b", "8b", "70b", "explicit", "gqa-bias-tied", "qk-norm"],
)
def test_flops_per_token_matches_the_model(shape):
    m = ModelSpec(**shape)
    assert mfu.param_count(m) == model.param_count(m)
    assert mfu.flops_per_token(m) == model.flops_per_token(m)


def test_the_8b_and_70b_presets_count_llama_3s_parameters():
    # Meta's model cards: Llama 3 8B has 8.03 B parameters, Llama 3 70B 70.6 B
    assert round(ModelSpec(preset="8b").params / 1e9, 2) == 8.03
    assert round(ModelSpec(preset="70b").params / 1e9, 1) == 70.6


def test_mfu_is_each_ranks_share_of_the_global_throughput_over_its_peak():
    # 1e6 FLOPs/token at 1000 tokens/s over 4 ranks = 2.5e8 FLOP/s per rank, of a 1e9 peak
    assert mfu.mfu(1e6, 1000.0, 4, 1e9) == pytest.approx(0.25)


def peak(metrics: AgentMetrics, tmp_path, precision: str, tf32: bool = True) -> float:
    """The MFU denominator the agent's collector uses for a rank running at `precision`."""
    path = tmp_path / f"{precision}-{tf32}.json"
    parallel = {"dp": 2, "pp": 1, "tp": 1, "precision": precision, "tf32": tf32}
    path.write_text(json.dumps({"model": {"preset": "tiny"}, "parallel": parallel}))
    return _AgentCollector(metrics, lambda: None)._model(path)[2]


def test_a_gpu_agent_takes_its_peak_from_the_datasheet_at_each_jobs_precision(tmp_path):
    """NVML's name for an H100 picks the H100 profile: its bf16 peak for a bf16 job, its TF32
    peak for an fp32 one (fp32 matmuls run on TF32 unless tf32 is off), its fp32 peak for a
    strict fp32 one; an operator's --peak-flops wins; a CPU keeps its core estimate."""
    h100 = H100_80GB.flops
    gpu = AgentMetrics(devices=8, device_name="NVIDIA H100 80GB HBM3")
    assert peak(gpu, tmp_path, "bf16") == h100["bf16"] == 989e12
    assert peak(gpu, tmp_path, "fp32") == h100["tf32"] == 494.7e12
    assert peak(gpu, tmp_path, "fp32", tf32=False) == h100["fp32"] == 67e12
    assert gpu.peak_flops == h100["bf16"]  # the gauge: the usual training precision's
    told = AgentMetrics(peak_flops=1.5e14, devices=8, device_name="NVIDIA H100 80GB HBM3")
    assert peak(told, tmp_path, "bf16") == 1.5e14
    cpu = AgentMetrics(devices=2)
    assert peak(cpu, tmp_path, "bf16") == mfu.default_peak_flops(2)
    unknown = AgentMetrics(devices=1, device_name="NVIDIA T4")
    assert unknown.peak_flops == mfu.default_peak_flops(1)
