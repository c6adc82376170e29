"""Fault injection inside the trainer: one flipped bit in one rank's state (the spec's
`chaos.bitflip`, accepted only by a controller started with --allow-chaos and only from an
admin; docs/architecture.md, "Silent data corruption").

A flip fires in the job's first generation only (generation 1, or 0 for a standalone run):
a recovery replays the step it hit, and a flip that fired again would never let the job pass
it. The flipped element is the first of this rank's largest parameter (its local shard), of
that parameter's gradient (after the reduction, just before the optimizer step: every replica
but this one applies the right update), or of its optimizer's first moment; `idle` flips the
parameter again, but after the step's snapshot and checkpoint copies. A `compute` flip
is no state at all: the spot check (worker/trainer/spot_check.py) asks `compute_fault` and
flips one activation of its first pass, as a transient fault in the device's arithmetic would.

`chaos.device_oom` makes the rank's allocator fail for real during a chosen step, in every
generation: an oversized batch or model fails again after any restart, and the controller must
tell that from a fault a restart cures (worker/trainer/oom.py).

`chaos.device_error` raises torch's own AcceleratorError during a chosen step, the error a
CUDA fault raises: once, in the first generation, as a failing GPU would; with `repeat`, in
every generation, as a fault of the job's own would (worker/trainer/device_fault.py).

`chaos.nondeterministic` makes every backward differ bitwise between executions, as a GPU's
kernels that accumulate with atomics do (`BackwardNoise`): the SDC replay then reproduces no
rank's history, and must blame by distance (worker/trainer/sdc.py, `drifted`).

`chaos.min_step_s` is no fault: it paces the steps (`StepFloor`), so a job lasts past the
faults injected around it whatever the machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.optim import Optimizer

from services.spec import BitFlip, DeviceError, DeviceOom
from worker.trainer.oom import device_bytes
from worker.trainer.snapshot_state import _local


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """XOR one bit of the first 32-bit word of `t` (a contiguous tensor or its local shard of
    at least 4 bytes: fp32 state, or a bf16 activation), in place."""
    # views all the way: reshape of a contiguous tensor, then its first four bytes
    word = t.reshape(-1).view(torch.uint8)[:4].view(torch.int32)
    mask = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 two's complement
    word.bitwise_xor_(mask)


class BitFlips:
    def __init__(
        self,
        flips: list[BitFlip],
        rank: int,
        generation: int,
        parts: list[nn.Module],
        optimizers: list[Optimizer],
        report: Callable[[dict], None],
    ):
        self.flips = [f for f in flips if f.rank == rank] if generation <= 1 else []
        self.report = report
        # the rank's largest parameter, and its optimizer (pipeline parts have one each)
        self.name, self.param, self.opt = max(
            (
                (n, p, opt)
                for part, opt in zip(parts, optimizers, strict=True)
                for n, p in part.named_parameters()
            ),
            key=lambda e: e[1].numel(),
        )

    def before_update(self, step: int) -> None:
        """Inside step `step`, after the gradient reduction."""
        for f in self._due(step, "grad"):
            self._flip(f, self.param.grad, f"{self.name} (grad)")

    def after_step(self, step: int) -> None:
        for f in self._due(step, "param"):
            self._flip(f, self.param.detach(), self.name)
        for f in self._due(step, "optim"):
            self._flip(f, self.opt.state[self.param]["exp_avg"], f"{self.name} (exp_avg)")

    def between_steps(self, step: int) -> None:
        """After step `step`'s snapshot and checkpoint copies, before the next step."""
        for f in self._due(step, "idle"):
            self._flip(f, self.param.detach(), self.name)

    def compute_fault(self, step: int) -> int | None:
        """The bit a `compute` flip at `step` flips in the spot check's first pass, once (None:
        no fault); the spot check flips it and calls `flipped`."""
        due = self._due(step, "compute")
        if not due:
            return None
        self.flips.remove(due[0])
        return due[0].bit

    def flipped(self, step: int, bit: int, what: str) -> None:
        """Report a flip made elsewhere (the spot check's), like the others."""
        self.report({"event": "chaos", "kind": "bitflip", "step": step, "tensor": what, "bit": bit})

    def _due(self, step: int, tensor: str) -> list[BitFlip]:
        return [f for f in self.flips if f.step == step and f.tensor == tensor]

    def _flip(self, f: BitFlip, t: torch.Tensor, name: str) -> None:
        with torch.no_grad():
            flip_bit(_local(t), f.bit)
        self.flipped(f.step, f.bit, name)


class BackwardNoise:
    """The gradient leaving each microbatch's logits, multiplied elementwise by factors within
    2^-20 of one (a few units in the last place of fp32), drawn at every execution from a
    generator nobody seeds. Each rank's local gradient then differs from any other execution's
    while the replicas still agree after the reduction, as on a GPU whose backward kernels
    accumulate with atomics. Off under deterministic algorithms (the spot check's passes), as
    those kernels are."""

    SPREAD = 2.0**-20

    def __init__(self):
        self.gen = torch.Generator()
        self.gen.seed()  # from the OS: no two executions draw the same factors

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.requires_grad and not torch.are_deterministic_algorithms_enabled():
            logits.register_hook(self._jitter)
        return logits

    def _jitter(self, grad: torch.Tensor) -> torch.Tensor:
        u = torch.rand(grad.shape, generator=self.gen, dtype=grad.dtype).to(grad.device)
        return grad * (1 + self.SPREAD * (2 * u - 1))


class DeviceOoms:
    def __init__(self, faults: list[DeviceOom], rank: int, device: torch.device):
        self.steps, self.device = {f.step for f in faults if f.rank == rank}, device

    def during(self, step: int) -> None:
        """At a chosen step, ask the allocator for more bytes than the device (or host) has."""
        if step in self.steps:
            too_many = 4 * device_bytes(self.device) + 2**40
            torch.empty(too_many, dtype=torch.uint8, device=self.device)


class DeviceErrors:
    def __init__(self, faults: list[DeviceError], rank: int, generation: int):
        self.steps = {f.step for f in faults if f.rank == rank and (f.repeat or generation <= 1)}

    def during(self, step: int) -> None:
        if step in self.steps:
            raise torch.AcceleratorError(
                f"CUDA error: an illegal memory access was encountered (chaos.device_error at "
                f"step {step})"
            )


class StepFloor:
    """Sleeps out the rest of `min_s` after each step, counted from the previous call (or
    the start), so the sleep is outside the step's own timing and its records."""

    def __init__(self, min_s: float):
        self.min_s, self.last = min_s, time.monotonic()

    def wait(self) -> None:
        rest = self.min_s - (time.monotonic() - self.last)
        if rest > 0:
            time.sleep(rest)
        self.last = time.monotonic()
