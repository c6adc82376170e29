"""The trainer zygote on a GPU host (worker/agent/zygote.py): it imports torch and the trainer
but never starts CUDA, since a process forked after CUDA started cannot use it; a trainer it
forks trains on the GPU."""

from __future__ import annotations

import time

import pytest

from services.procs import free_port
from tests.launch import ENV, step_records, trainer_args
from tests.stack import tiny_spec
from worker.agent.launcher import Launcher

pytestmark = pytest.mark.gpu


def compute_pids() -> set[int]:
    """Every process that holds a CUDA context on any GPU, as the driver sees it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return {p.pid for h in handles for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    finally:
        pynvml.nvmlShutdown()


def test_the_zygote_never_starts_cuda_and_its_forked_trainer_trains_on_the_gpu(tmp_path):
    launcher = Launcher(tmp_path, 1, dict(ENV))
    try:
        launcher.refill()
        assert launcher.ready(timeout_s=120), (tmp_path / "zygote.log").read_text()
        assert launcher.zygote.pid not in compute_pids()
        world, args = trainer_args(tiny_spec("zygote-gpu", parallel={"dp": 1}), tmp_path)
        env = {
            "RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        rank = launcher.launch(args, env, tmp_path / "rank0.log")
        deadline = time.monotonic() + 300
        while rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        log = (tmp_path / "rank0.log").read_text()
        assert rank.poll() == 0, log[-3000:]
        assert len(step_records(tmp_path)) == 12, log[-3000:]
        assert launcher.zygote.pid not in compute_pids()  # forking left it as it was
    finally:
        launcher.close()
