"""A fixed GEMM timed on the GPU: the straggler signal where the step's own time cannot be.

On CUDA the step clock (worker/trainer/timing.py, `CudaClock`) times the step's stream, and
inside forward and backward that stream waits on NCCL's: FSDP's all-gathers, TP's reductions.
A synchronous job's ranks wait for the slowest one, so each reports about the same time and a
slow GPU hides in its peers' waits. The probe runs the same matmul (shape, dtype, values) on
every rank's device at the start of each step, before the step's first kernel and after the
previous step's last (its host sync), so no communication is in it: what it measures is the
device's own throughput. A GPU that is throttled (power, heat), slowed by a fault, or shared
with another process takes longer, and the controller compares that across ranks
(controller/health.py, `straggler`).

Chosen over kernel timing without NCCL's kernels (CUPTI, as NVRx does) because it needs no
profiler hooks and is the same measurement on every rank. The cost: one 4096^3 bf16 GEMM,
137 GFLOP, about 0.2 ms on an H100 (under 0.5% of a 100 ms step), three 32 MiB buffers, and no
host sync of its own: its events are read after the step's.
"""

from __future__ import annotations

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
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def launch(self) -> None:
        """Queue the GEMM on the current stream, between two timing events."""
        self._begin.record()
        torch.mm(self.a, self.b, out=self.out)
        self._end.record()

    def seconds(self) -> float:
        """The GEMM's device time; call after a host sync that follows `launch` (the step's)."""
        return self._begin.elapsed_time(self._end) / 1e3


def device_probe(device: torch.device) -> DeviceProbe | None:
    """The probe for a rank on `device`: on CUDA only, where the step clock cannot tell a slow
    device from its peers' waits (a CPU rank's clock excludes them; timing.py)."""
    return DeviceProbe(device) if device.type == "cuda" else None
