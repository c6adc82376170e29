"""The rank's process group: set up from the torchrun environment, torn down quietly."""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from services.procs import free_port


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Without RANK in the environment: a one-rank world."""
    if "RANK" not in os.environ:  # a plain single-process run
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Ranks share the host's cores; more threads than cores only thrash. An explicit
        # OMP_NUM_THREADS wins: several agents on one host (the local stack, the tests) each
        # see LOCAL_WORLD_SIZE=1 and would otherwise all take every core.
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return rank, world, device


def shutdown_distributed() -> None:
    # Pipeline sends are asynchronous: a peer may still be reading when this rank is
    # done. Quiesce first, so no gloo worker thread still holds a tensor at teardown
    # (that ends in SIGABRT during interpreter finalization).
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
