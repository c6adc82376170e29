"""A rank whose allocator ran out of memory exits with `EXIT_OOM`, and a message that sets its
peak against the planner's estimate for its layout and names the fix. The controller fails
the job at once (controller/health.py `DETERMINISTIC_EXITS`): a spare has the same memory,
so replacing or restarting the rank would only fail again."""

from __future__ import annotations

import torch

from services.planner import cluster
from services.planner.hardware import host_memory_per_device, profile_of_device
from services.planner.layout import Layout
from services.planner.memory import rank_memory
from services.spec import JobSpec
from worker.trainer.memory import peak_mem_bytes

EXIT_OOM = 5  # 2, 3 and 4 are taken (worker/trainer/main.py)


class OutOfMemory(RuntimeError):
    """The rank's allocator failed; the message is for the job's user."""


def is_out_of_memory(e: BaseException) -> bool:
    """The CUDA caching allocator's error, or the CPU allocator's (a RuntimeError of its own)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


def device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_per_device(1)


def planned_bytes(spec: JobSpec, device: torch.device) -> int | None:
    """The planner's per-rank peak for the spec's layout on this device (services/planner)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        where = cluster(profile_of_device(name) or "cpu", 1, 1, device_bytes(device) or None)
        return rank_memory(spec, Layout.of(spec.parallel), where).total
    except ValueError:
        return None


def explain(e: BaseException, spec: JobSpec, device: torch.device) -> OutOfMemory:
    p = spec.parallel
    planned = planned_bytes(spec, device)
    estimate = f"{_gib(planned)} per rank" if planned else "no estimate"
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return OutOfMemory(
        f"out of memory on {device} ({first}). This rank's peak so far: "
        f"{_gib(peak_mem_bytes(device))} of {_gib(device_bytes(device))}; the planner's "
        f"estimate for dp={p.dp} pp={p.pp} tp={p.tp} zero={p.zero}: {estimate} (`meshkeeper "
        "plan` shows its parts). Fewer bytes per rank fix it: parallel.zero 3, a larger "
        "parallel.tp or parallel.pp, parallel.activation_checkpointing, more "
        "parallel.microbatches, or devices with more memory"
    )


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "unknown"
