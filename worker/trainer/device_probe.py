"""A fixed GEMM timed on the GPU: the straggler signal where the step's own time cannot be.

On CUDA the step clock (worker/trainer/timing.py, `CudaClock`) times the step's stream, and
inside forward and backward that stream waits on NCCL's: FSDP's all-gathers, TP's reductions.
A synchronous job's ranks wait for the slowest one, so each reports about the same time and a
slow GPU hides in its peers' waits. The probe runs the same matmul (shape, dtype, values) on
every rank's device before each step, when the previous step's sync has left the GPU idle
and no communication is queued, and times it from launch to completion on the host: a GPU
that is throttled (power, heat), slowed by a fault, or time-sliced with another process
takes longer. The controller compares that across ranks (controller/health.py, `straggler`).

Why host time and not CUDA events around the GEMM: measured on an H200 with a second process
running GEMMs on the same GPU, the events moved from 0.19 to 0.22 ms (a context switch delays
both of them), while the rank's steps were as slow as the sharing made them.

Chosen over kernel timing without NCCL's kernels (CUPTI, as NVRx does) because it needs no
profiler hooks and is the same measurement on every rank. The cost: one 4096^3 bf16 GEMM,
137 GFLOP, about 0.2 ms on an H100 or H200 (0.2% of a 100 ms step), and three 32 MiB buffers.
"""

from __future__ import annotations

import time

import torch

SIZE = 4096  # large enough for a stable time (hundreds of us), small beside a real step


class DeviceProbe:
    def __init__(self, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(0)  # the same on every rank
        self.a, self.b = (
            torch.randn(SIZE, SIZE, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(2)
        )
        self.out = torch.empty_like(self.a)
        self._done = torch.cuda.Event()

    def seconds(self) -> float:
        """Run the GEMM on the current stream and wait for it: seconds from launch to done."""
        t0 = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        self._done.record()
        self._done.synchronize()
        return time.perf_counter() - t0


def device_probe(device: torch.device) -> DeviceProbe | None:
    """The probe for a rank on `device`: on CUDA only, where the step clock cannot tell a slow
    device from its peers' waits (a CPU rank's clock excludes them; timing.py)."""
    return DeviceProbe(device) if device.type == "cuda" else None
