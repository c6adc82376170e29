"""The CUDA/NCCL path on a real GPU (skipped without one; tests/conftest.py): device discovery
agrees with torch, a one-rank NCCL process group forms on the rank's device with the failure
handling worker/trainer/distributed.py sets, CUDA events time a step's GPU work, and with two
GPUs a dp2 job on NCCL matches the single process."""

from __future__ import annotations

import os

import pytest
import torch

from services.planner.hardware import profile_of_device
from services.procs import free_port
from tests.launch import train
from tests.stack import tiny_spec
from worker.devices import discover
from worker.trainer.timing import CudaClock

pytestmark = pytest.mark.gpu


def test_nvml_discovery_agrees_with_torch():
    gpus = discover()
    assert len(gpus) == torch.cuda.device_count()
    # the MFU's datasheet peak is found by NVML's name: the same model as torch's name
    for g in gpus:
        assert profile_of_device(g.name) == profile_of_device(
            torch.cuda.get_device_name(g.cuda_index)
        )


def test_one_rank_nccl_group_forms_on_its_device_and_reduces(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from worker.trainer.distributed import hold_timeouts, init_distributed, shutdown_distributed
    from worker.trainer.parallel import mesh_groups

    # set through monkeypatch, so what init_distributed writes is undone after the test
    world_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for var, value in {**world_env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")  # what the trainer must turn off
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "0")
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "1")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    rank, world, device = init_distributed(timeout_s=60.0)
    try:
        assert (rank, world, device) == (0, 1, torch.device("cuda", 0))
        assert dist.get_backend() == "cuda:nccl,cpu:gloo"
        nccl = {k: v for k, v in os.environ.items() if k.startswith("TORCH_NCCL_")}
        assert nccl == {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_NCCL_BLOCKING_WAIT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "120",
        }
        t = torch.full((4,), 3.0, device=device)
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 4
        # every mesh group holds the timeout on both of its backends (NCCL and gloo)
        mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
        held = hold_timeouts({"world": dist.group.WORLD, **mesh_groups(mesh)}, 45.0)
        assert held == {"world": 45.0, "dp": 45.0, "pp": 45.0, "tp": 45.0}
    finally:
        shutdown_distributed()
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # set by the trainer, not here


def test_cuda_events_time_gpu_work_and_leave_out_waiting_sections():
    # torch.cuda._sleep spins the GPU for a number of cycles: a kernel of known, fixed length
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # an idle GPU runs its first kernel at idle clocks: warm it up
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    alone_s = begin.elapsed_time(end) / 1e3
    clock = CudaClock()
    clock.start()
    torch.cuda._sleep(cycles)  # the step's own work
    with clock.waiting():
        torch.cuda._sleep(3 * cycles)  # a collective the stream waits for
    assert clock.stop() == pytest.approx(alone_s, rel=0.2)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_dp2_on_nccl_matches_one_process(tmp_path):
    spec = tiny_spec("nccl-dp2", train={"steps": 4}, parallel={"tf32": False})  # strict fp32
    one = train({**spec, "parallel": {"dp": 1, "tf32": False}}, tmp_path / "one")
    two = train(spec, tmp_path / "two")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
