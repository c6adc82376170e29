"""A real CUDA error on the device (worker/trainer/device_fault.py): an index past a tensor's end
fires a device-side assert, which torch raises as its AcceleratorError, the error the trainer
turns into `EXIT_DEVICE`. The agent's NVML watch (worker/agent/device_health.py), opened before
the fault, reads the device after it; what it saw goes to `make gpu-check`'s summary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch import ENV, ROOT
from worker.agent.device_health import DeviceHealth
from worker.devices import discover

pytestmark = pytest.mark.gpu

FAULT = """
import torch
from worker.trainer.device_fault import explain_fault, is_device_fault
x = torch.zeros(4, device="cuda")
try:
    x[torch.tensor([1 << 20], device="cuda")] = 1.0  # checked on the device, not the host
    torch.cuda.synchronize()
    print("no error")
except Exception as e:
    print(type(e).__name__, is_device_fault(e), explain_fault(e, x.device))
"""


def test_a_device_side_assert_is_a_device_fault_and_nvml_reads_the_gpu_after_it(measured):
    gpus = discover()
    health = DeviceHealth(gpus)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", FAULT],
            cwd=ROOT,
            env={**ENV, "CUDA_VISIBLE_DEVICES": gpus[0].uuid},
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
        assert said.startswith("AcceleratorError True device error on cuda:0 ("), said
        evidence = health.evidence(gpus[0].cuda_index)
    finally:
        health.close()
    measured("device_fault_nvml", evidence)
    assert evidence is not None and evidence["uuid"] == gpus[0].uuid, evidence
    assert not evidence.get("lost") and not evidence.get("remap_failed"), evidence
    xids = evidence["xids"]
    assert all(isinstance(x, int) and x > 0 for x in xids), evidence
