"""This rank's peak memory, carried by every step record as `peak_mem_bytes`
(docs/architecture.md, "Records")."""

from __future__ import annotations

import torch

from worker.peak_rss import high_water_mark


def peak_mem_bytes(device: torch.device) -> int:
    """The process's peak so far: on GPU the caching allocator's `max_memory_allocated` (what
    tensors held, the number to compare with parameter, gradient and optimizer sizes); on CPU
    the peak resident set (VmHWM, worker/peak_rss.py), 0 where /proc cannot say."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return high_water_mark() or 0
