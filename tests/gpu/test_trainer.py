"""One rank training the `1b` preset's layer shapes (two layers) in bf16 on one GPU: the step
time, the model FLOPs utilisation against the device's datasheet peak, and the peak memory
against the planner's estimate for that layout (services/planner/memory.py)."""

from __future__ import annotations

import statistics

import pytest
import torch

from services.planner import cluster
from services.planner.hardware import profile_of_device
from services.planner.layout import Layout
from services.planner.memory import rank_memory
from services.spec import parse_spec
from tests.launch import train
from worker.mfu import flops_per_token

pytestmark = pytest.mark.gpu


def device_profile() -> str:
    name = torch.cuda.get_device_name(0)
    found = profile_of_device(name)
    if found is None:
        pytest.skip(f"no planner profile for {name!r}")
    return found


def test_bf16_1b_layers_step_time_mfu_and_memory_against_the_plan(tmp_path, measured):
    raw = {
        "name": "gpu-1b",
        "model": {"preset": "1b", "layers": 2},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 1, "precision": "bf16"},
        "train": {"steps": 10, "global_batch": 4, "lr": 3e-4, "warmup_steps": 2},
    }
    records = train(raw, tmp_path, timeout=400)
    spec, where = parse_spec(raw), cluster(device_profile(), 1, 1)
    steady = records[3:]  # the first steps pay for allocation, autotuning and NCCL set-up
    step_s = statistics.median(r["step_s"] for r in steady)
    tokens = raw["train"]["global_batch"] * spec.model.seq_len
    mfu = flops_per_token(spec.model) * tokens / step_s / where.device.flops["bf16"]
    peak = max(r["peak_mem_bytes"] for r in records)
    probe_s = statistics.median(r["probe_s"] for r in steady)
    plan = rank_memory(spec, Layout.of(spec.parallel), where).total
    for name, value in {
        "trainer_1b2l_bf16_step_s": step_s,
        "trainer_1b2l_bf16_mfu": mfu,
        "trainer_1b2l_bf16_peak_bytes": peak,
        "trainer_1b2l_bf16_planned_bytes": plan,
        "trainer_1b2l_bf16_peak_over_plan": peak / plan,
        "trainer_1b2l_bf16_probe_ms": probe_s * 1e3,
    }.items():
        measured(name, value)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    # sanity bounds only: the plan is an estimate, and the figures go to the summary
    assert 0.01 < mfu < 1.0, mfu
    assert 0.3 < peak / plan < 2.0, (peak, plan)
    assert all(r["probe_s"] > 0 for r in records)  # every step carries the straggler signal
    assert probe_s < step_s / 20, (probe_s, step_s)  # and it costs a small part of the step


def test_fp32_runs_its_matmuls_on_tf32_unless_the_spec_says_strict(tmp_path, measured):
    """The default fp32 job runs its matmuls on TF32 tensor cores (ParallelSpec.tf32): its
    numbers differ from strict fp32's from the first step on, and its steps are faster."""

    def run(tf32: bool) -> list[dict]:
        raw = {
            "name": "gpu-fp32-tf32" if tf32 else "gpu-fp32-strict",
            "model": {"preset": "1b", "layers": 2},
            "data": {"source": "synthetic", "seed": 7},
            "parallel": {"dp": 1, "precision": "fp32", "tf32": tf32},
            "train": {"steps": 6, "global_batch": 2, "lr": 3e-4},
        }
        return train(raw, tmp_path / str(tf32), timeout=400)

    tf32, strict = run(True), run(False)
    step = {
        name: statistics.median(r["step_s"] for r in rs[2:])
        for name, rs in (("tf32", tf32), ("strict", strict))
    }
    measured("trainer_1b2l_fp32_step_s_tf32", step["tf32"])
    measured("trainer_1b2l_fp32_step_s_strict", step["strict"])
    assert tf32[0]["loss"] != strict[0]["loss"]  # TF32's rounding is in the first forward
    assert abs(tf32[0]["loss"] - strict[0]["loss"]) < 1e-2  # and only its rounding
    assert step["strict"] > 1.2 * step["tf32"], step


def test_the_state_at_rest_check_costs_a_small_part_of_a_step(tmp_path, measured):
    """The same 1b-shaped bf16 job with and without `sdc.at_rest` (worker/trainer/at_rest.py:
    three reads of the rank's whole state and one one-flag all-reduce per step, between the
    steps): the median time from one step record to the next, which holds everything a step
    costs, checks included."""

    def gap(at_rest: bool) -> float:
        raw = {
            "name": "gpu-at-rest" if at_rest else "gpu-unchecked",
            "model": {"preset": "1b", "layers": 2},
            "data": {"source": "synthetic", "seed": 7},
            "parallel": {"dp": 1, "precision": "bf16"},
            "train": {"steps": 12, "global_batch": 4, "lr": 3e-4, "warmup_steps": 2},
            "sdc": {"at_rest": at_rest},
        }
        times = [r["time"] for r in train(raw, tmp_path / raw["name"], timeout=400)[3:]]
        return statistics.median(b - a for a, b in zip(times[:-1], times[1:], strict=True))

    checked, unchecked = gap(True), gap(False)
    measured("trainer_1b2l_bf16_gap_s_at_rest", checked)
    measured("trainer_1b2l_bf16_gap_s_unchecked", unchecked)
    measured("at_rest_overhead", checked / unchecked - 1)
    assert checked < 1.5 * unchecked, (checked, unchecked)  # sanity only; the figure is reported
