"""The NCCL path's set-up that runs without a GPU (worker/trainer/distributed.py,
worker/trainer/timing.py): the ProcessGroupNCCL environment aligned with the process group's
timeout, the device index checked against the GPUs a process sees, and the clock per device."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from services.hang_bounds import collective_timeout_s, hang_bound_s
from worker.trainer.distributed import cuda_device, nccl_environment
from worker.trainer.timing import CpuClock, step_clock


def test_nccl_aborts_the_process_on_a_timeout_and_never_blocks_the_host():
    env = nccl_environment(300.0, {})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"


def test_an_operators_async_error_handling_is_kept_but_blocking_wait_is_not():
    env = nccl_environment(
        300.0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    )
    assert (env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_NCCL_BLOCKING_WAIT"]) == ("1", "0")


def test_the_watchdog_monitor_fires_only_after_twice_the_collective_timeout():
    env = nccl_environment(60.5, {})
    assert (env["TORCH_NCCL_ENABLE_MONITORING"], env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) == (
        "1",
        "121",
    )


def test_the_flight_recorder_dumps_into_the_run_directory_on_a_timeout():
    env = nccl_environment(60.0, {"TORCH_FR_BUFFER_SIZE": "500"}, Path("/run/g3/flight-rank"))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/run/g3/flight-rank"
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert env["TORCH_INCLUDE_STACK_TRACE"] == "0"  # a dump that fits the short wait


@pytest.mark.parametrize("hang_after_s", [2.5, 10.0, 60.0, 600.0])
def test_the_abort_after_the_dump_lands_before_the_controllers_bound(hang_after_s):
    # the watchdog sleeps 4 x the dump wait between the timeout and the abort (torch's
    # ProcessGroupNCCL watchdog loop); at torch's default wait (15 s) that is 60 s
    params = 10**9
    timeout = collective_timeout_s(hang_after_s, cuda=True, stepping=True, params=params)
    env = nccl_environment(timeout, {})
    abort_at = timeout + 4 * int(env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) / 1000
    assert abort_at < hang_bound_s(hang_after_s, stepping=True, params=params), env


def test_the_device_is_the_local_rank_among_the_visible_gpus():
    assert cuda_device(1, 2) == torch.device("cuda", 1)


def test_a_local_rank_past_the_visible_gpus_is_refused_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 6 names no GPU: this process sees 2"):
        cuda_device(6, 2)


def test_a_cpu_rank_gets_the_cpu_clock():
    assert isinstance(step_clock(torch.device("cpu")), CpuClock)


def test_the_cpu_clock_does_not_count_time_blocked():
    # sleeping is what a rank blocked in a collective does: no CPU demand
    clock = CpuClock()
    clock.start()
    with clock.waiting():
        time.sleep(0.3)
    assert clock.stop() < 0.1
