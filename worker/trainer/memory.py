"""This rank's peak memory, carried by every step record as `peak_mem_bytes`
(docs/architecture.md, "Records"), and how freed host memory goes back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from worker.peak_rss import high_water_mark


def peak_mem_bytes(device: torch.device) -> int:
    """The process's peak so far: on GPU the caching allocator's `max_memory_allocated` (what
    tensors held, the number to compare with parameter, gradient and optimizer sizes); on CPU
    the process's own peak resident set (VmHWM less the pages shared with the zygote and
    other processes, worker/peak_rss.py), 0 where /proc cannot say."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return high_water_mark() or 0


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_BYTES = 4 << 20  # blocks from here up are mapped on their own, unmapped when freed
_TRIM_BYTES = 64 << 20  # free memory a heap keeps at its top for the next step


def return_freed_memory() -> bool:
    """Have glibc give freed memory back to the OS at once; False where libc is not glibc.

    By default glibc raises its mmap threshold to the size of each large block freed (up to
    32 MiB), so later tensors of that size come from heaps that are trimmed only from the top,
    and freed ones stay resident below anything allocated after them: the 1b preset at 4
    layers (tests/numerics/test_real_size.py) went past 21.5 GiB in step 2, and peaks at
    19.9-20.7 GiB with this (issue 12). Blocks from 4 MiB up are now mapped and unmapped on
    their own. The heaps, which hold only the blocks below that, keep up to 64 MiB free at
    their top: a step frees and allocates again the same small tensors, and trimming at 4 MiB
    gave those pages back and faulted them in again at every step (about 1,400 faults a step
    on `small` at dp2, 2,400 with its gradients reduced into snapshot slots, which changes
    what the heap holds across a step; 30 with this). The number of arenas is left alone:
    capping it at 2 cost a tenth of zero-0 throughput at dp2 (bench/throughput.py: 0.89 of
    DDP against 1.01), its threads contending for the same heap locks. GPU tensors never come
    here."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallopt"):
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES)
    return True
