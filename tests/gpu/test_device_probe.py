"""The device probe (worker/trainer/device_probe.py), the straggler signal on GPUs: its GEMM
takes longer on a GPU that another process keeps busy, by more than the straggler bound's
default 1.5x, where the step clock of a synchronous job would only show its peers' waits."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest
import torch

from services.spec import StragglerSpec
from worker.trainer.device_probe import DeviceProbe

pytestmark = pytest.mark.gpu

# Another process's work on the same GPU: large bf16 GEMMs, back to back, until killed.
HOG = """
import sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ a
torch.cuda.synchronize()
print("busy", flush=True)
while True:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def probe_times(probe: DeviceProbe, n: int) -> list[float]:
    times = []
    for _ in range(n):
        times.append(probe.seconds())
    return times


def test_a_gpu_shared_with_another_process_is_slower_at_the_probe(measured):
    probe = DeviceProbe(torch.device("cuda", 0))
    probe_times(probe, 10)  # clocks up, cuBLAS's heuristics chosen
    alone = statistics.median(probe_times(probe, 50))
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    try:
        line = hog.stdout.readline()
        if line.strip() != "busy":  # e.g. a GPU in exclusive-process compute mode
            pytest.skip(f"a second process could not use the GPU (it said {line!r})")
        time.sleep(0.5)
        shared = statistics.median(probe_times(probe, 50))
    finally:
        hog.kill()
        hog.wait()
    measured("probe_ms_alone", alone * 1e3)
    measured("probe_ms_shared", shared * 1e3)
    assert 1e-5 < alone < 0.05, alone  # sanity: a 4096^3 bf16 GEMM on a datacenter GPU
    assert shared > StragglerSpec().slowdown * alone, (alone, shared)
