"""The re-admission probe on a GPU worker (worker/agent/probe.py): besides the CPU matmul and
the gloo all-reduce, every visible GPU allocates 1 GiB and computes the exact matmul, and
one NCCL all-reduce runs across them all."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.launch import ENV, ROOT

pytestmark = pytest.mark.gpu


def test_the_probe_exercises_every_gpu_and_nccl():
    proc = subprocess.run(
        [sys.executable, "-m", "worker.agent.probe"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and result["passed"], (result, proc.stderr[-2000:])
    gpus = torch.cuda.device_count()
    assert f"NCCL all-reduce ok on {gpus} GPU(s)" in result["detail"], result
