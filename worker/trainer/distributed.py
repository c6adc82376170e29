"""The rank's process group: set up from the torchrun environment, torn down quietly.

On GPU (docs/architecture.md, "Parts", "Trainer": NCCL plus gloo) the rank's device is
`cuda:LOCAL_RANK`, the index its agent derived from the worker's own visible GPUs
(worker/devices.py), and NCCL's failure handling is set so that a hang ends the way the
controller expects (controller/aborts.py). Per torch 2.13's ProcessGroupNCCL environment
variables (docs: torch_nccl_environment_variables):
- the process group's timeout is the one `init_distributed` is given: on CUDA half the
  controller's hang bound (services/hang_bounds.py), so the watchdog's abort, which names the
  rank the others waited on, always arrives before the controller's own bound expires; every
  group gets it (`hold_timeouts`), and it is shortened after the first step;
- TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default, kept unless the operator set it): on a
  timed-out or failed collective the watchdog tears the process down without aborting the
  communicator first (aborting can itself hang on a broken peer). The process dies of
  SIGABRT, which the controller reads as collateral, and blames the rank the aborted ones
  waited on;
- TORCH_NCCL_BLOCKING_WAIT=0, always: blocking wait makes every `wait()` spin the host until
  the collective ends (no compute/communication overlap) and turns a timeout into a Python
  exception on the training thread, an ordinary failure that blames nobody;
- TORCH_NCCL_ENABLE_MONITORING=1 with TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC at twice the timeout:
  the monitor thread kills the process only when the watchdog itself is stuck (in a CUDA or
  NCCL call); later than the watchdog's own timeout, so a plain hang is always reported by the
  watchdog first, and within the controller's bound for independent hangs (2 x hang_after_s);
- the flight recorder (worker/flight_record.py): TORCH_FR_BUFFER_SIZE entries (2000, torch's
  default, unless the operator set it; TORCH_NCCL_TRACE_BUFFER_SIZE, its older name, alike),
  TORCH_NCCL_DUMP_ON_TIMEOUT=1, and the dump written into the rank's run directory
  (TORCH_FR_DUMP_TEMP_FILE, and TORCH_NCCL_DEBUG_INFO_TEMP_FILE, its older name), where its
  agent reads it after the abort;
- TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC at an eighth of the timeout, at most 1 s: on a timeout the
  watchdog sleeps four times this before it aborts, so every rank's monitor (polling the
  store's dump signal each second) has written its dump. torch's default, 15 s, would hold the
  abort 60 s past the timeout, past the controller's bound, which then calls a blameless stall;
- TORCH_INCLUDE_STACK_TRACE=0 unless the operator set it: the monitor waits that same short
  time for its dump, and symbolizing every entry's stack can outlast it; the blame reads
  sequence numbers and states only.
"""

from __future__ import annotations

import gc
import math
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from services.assignment import STORE_SPACE_ENV
from services.procs import free_port


def init_distributed(timeout_s: float, flight: Path | None = None) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Without RANK in the environment: a one-rank world.
    `flight`: where NCCL's flight recorder dumps (nccl_environment)."""
    if "RANK" not in os.environ:  # a plain single-process run
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    bind: torch.device | None = None
    os.environ.update(cuda_environment(os.environ))  # before anything starts CUDA's libraries
    if torch.cuda.is_available():
        device = bind = cuda_device(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
        os.environ.update(nccl_environment(timeout_s, os.environ, flight))
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Ranks share the host's cores; more threads than cores only thrash. An explicit
        # OMP_NUM_THREADS wins: several agents on one host (the local stack, the tests) each
        # see LOCAL_WORLD_SIZE=1 and would otherwise all take every core.
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    timeout = timedelta(seconds=timeout_s)
    space = os.environ.get(STORE_SPACE_ENV)
    if rank != 0 or space:
        wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)
    # device_id binds the group to this rank's GPU: NCCL's communicator forms now (a broken
    # NCCL fails here, not at the first step) and subgroups split from it.
    if space:  # the job's store, which an agent hosts (worker/agent/job_store.py)
        store = dist.PrefixStore(space, store_client(timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=bind
        )
    else:  # rank 0 hosts this generation's store (env://)
        dist.init_process_group(backend, timeout=timeout, device_id=bind)
    return rank, world, device


def store_client(timeout: timedelta) -> dist.TCPStore:
    """A client of the rendezvous store at MASTER_ADDR:MASTER_PORT."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )


STORE_POLL_S = 0.005


def wait_for_store(host: str, port: int, timeout_s: float) -> None:
    """Return once the rendezvous store (rank 0's TCPStore) accepts connections. torch's
    store client backs off for about 0.3 s after a refused connect, and in a recovery the
    other ranks usually start before rank 0 (whose agent stops the old rank 0 first): this
    probe every 5 ms lets them connect when the store comes up, not a backoff later."""

    def probe() -> None:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass

    try:
        Retrying(
            wait=wait_fixed(STORE_POLL_S),
            stop=stop_after_delay(timeout_s),
            retry=retry_if_exception_type(OSError),
            reraise=True,
        )(probe)
    except OSError as e:
        raise RuntimeError(
            f"the rendezvous store at {host}:{port} (rank 0's) accepted no connection within "
            f"{timeout_s:.0f}s ({e}); is rank 0 running, and is MASTER_ADDR reachable from here?"
        ) from e


def cuda_device(local_rank: int, visible: int) -> torch.device:
    """`cuda:<local_rank>`, checked against the GPUs this process sees."""
    if not 0 <= local_rank < visible:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} names no GPU: this process sees {visible} "
            "(CUDA_VISIBLE_DEVICES applied); the agent derives LOCAL_RANK from its own devices, "
            "so start it with --devices at most its visible GPUs"
        )
    return torch.device("cuda", local_rank)


def nccl_environment(
    timeout_s: float, environ: Mapping[str, str], flight: Path | None = None
) -> dict[str, str]:
    """The ProcessGroupNCCL variables to set before the group is created (see the module
    docstring for why each); an operator's own TORCH_NCCL_ASYNC_ERROR_HANDLING and flight
    recorder size are kept. `flight`: where the flight recorder's dump goes (torch appends the
    global rank); None leaves torch's default place."""
    entries = environ.get("TORCH_FR_BUFFER_SIZE", environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(math.ceil(2 * timeout_s)),
        "TORCH_FR_BUFFER_SIZE": entries or "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": entries or "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(max(1, min(1000, int(timeout_s * 1000 / 8)))),
        "TORCH_INCLUDE_STACK_TRACE": environ.get("TORCH_INCLUDE_STACK_TRACE", "0"),
        **(
            {"TORCH_FR_DUMP_TEMP_FILE": str(flight), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(flight)}
            if flight
            else {}
        ),
    }


def cuda_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """CUDA's settings read once, when its libraries start; an operator's own are kept.
    - CUBLAS_WORKSPACE_CONFIG=:4096:8: cuBLAS's fixed workspace, without which its GEMMs are
      not deterministic and the spot check's bitwise comparison fails on healthy GPUs
      (worker/trainer/spot_check.py; torch's "Reproducibility" notes);
    - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows segments in
      place instead of leaving freed blocks of the wrong size, so a long run's fragmentation
      does not end in an out-of-memory the planner's estimate did not foresee."""
    return {
        "CUBLAS_WORKSPACE_CONFIG": environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
        "PYTORCH_CUDA_ALLOC_CONF": environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
        ),
    }


def hold_timeouts(groups: Mapping[str, dist.ProcessGroup], timeout_s: float) -> dict[str, float]:
    """Give every group the trainer uses the world's timeout; returns each one's as read back.
    Only the world group gets it from `init_process_group`: a DeviceMesh subgroup (the FSDP,
    TP, PP and EP traffic) or a `new_group` (the checkpoint's and the snapshots') otherwise
    keeps torch's default, 30 minutes for gloo and for the composite `cuda:nccl,cpu:gloo`, so
    a hung peer would hold the job half an hour instead of `hang_after_s`."""
    limit = timedelta(seconds=timeout_s)
    for group in groups.values():
        dist.distributed_c10d._set_pg_timeout(limit, group)  # each of the group's backends
    return {name: group_timeout_s(group) for name, group in groups.items()}


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The shortest timeout among the group's backends (gloo for CPU tensors, NCCL for CUDA)."""
    return min(
        group._get_backend(device).options._timeout.total_seconds()
        for device in group._device_types
    )


def rendezvous_store(prefix: str) -> dist.Store:
    """A key space of its own in the world's rendezvous store, for agreements that must not
    wait in a collective: a store wait has its own timeout, given per call. Inside this
    generation's space of the job's store, where there is one: the store outlives the
    generation, and a later one must not read this one's answers."""
    space = os.environ.get(STORE_SPACE_ENV)
    base = store_client(timedelta(seconds=60))
    return dist.PrefixStore(f"{space}/{prefix}" if space else prefix, base)


def shutdown_distributed(quiesce: bool = True) -> None:
    """Tear the process group down. `quiesce` (a rank that finished with its peers): wait at a
    barrier first, because pipeline sends are asynchronous and a peer may still be reading;
    no gloo worker thread may still hold a tensor at teardown (that ends in SIGABRT during
    interpreter finalization). A rank that failed on its own does not wait: its peers would
    never reach the barrier, and its own exit code would arrive only after the timeout."""
    if not dist.is_initialized():
        return
    try:
        if quiesce:
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
