"""A logged step's gradients reduced straight into its slot (docs/architecture.md, "Logged
steps").

A logged step holds the step's clipped gradients and the buffers (worker/snapshots.py), and
copying those gradients was most of what it cost on a host whose memory the copy shares with
the step (bench/snapshot_cost.py). Under FSDP2 (`parallel.zero` 2 or 3) each group's
reduce-scatter output *is* the storage of its sharded gradients: FSDP views every gradient out
of it, the clip scales them there, the optimizer step reads them there, and the step after
sets fresh ones. So when that output is allocated in the slot the step is about to be logged
into, the slot holds the gradients without a copy, and the snapshot thread writes only what
lies elsewhere (the buffers) and the manifest.

`GradSlots` claims the next slot of the rank's logged-step ring once per step, on the
training thread, the only thread that claims in that ring: at the step's first placed
reduce-scatter output, or in `seal` (just before the optimizer step) where nothing was
placed. Whatever the snapshot makes of the step (a logged step, a whole snapshot, nothing),
the slot was claimed, so that ring has two slots more than the held one
(`SnapshotPlan.own_grads_slots`).

`SlotReduceScatter` is FSDP's default reduce-scatter whose allocator puts its group's first
output of a step in the claimed slot. It tells the output from the input (allocated just
before it, `world size` times larger) by the output's size, learned from its first call: the
first step's gradients stay where torch puts them. Later outputs of the same step stay there
too: under gradient accumulation they are temporaries that FSDP adds into the first. A GPU, a
layout without FSDP, a reduce over one rank (FSDP then copies, without calling the comm) or a
slot that cannot be mapped all leave the gradients where torch put them, and the snapshot
copies them, as it did before (`snapshot_state.in_slot`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from worker.snapshots import HEADER_BYTES
from worker.trainer.snapshot_state import aligned


@dataclass
class GradSlot:
    """One step's claimed slot of the logged-step ring; `used`: where the bytes placed in it
    end (the snapshot writes the rest after them)."""

    index: int
    bin: Path
    manifest_path: Path
    image: torch.Tensor
    used: int = HEADER_BYTES


class GradSlots:
    """The logged-step ring's slots, one claimed per step on the training thread."""

    def __init__(self, ring, rest_bytes: int):
        """`ring`: the rank's own logged-step Ring (worker/trainer/snapshot.py); `rest_bytes`:
        room for everything a logged step may copy (every gradient and buffer, aligned)."""
        self.ring, self.rest_bytes = ring, rest_bytes
        self.epoch = 0  # one per step: a comm places its first output of each
        self.placed_bytes = 0  # room for the outputs the comms learned the sizes of
        self.current: GradSlot | None = None
        self.error = ""

    def learn(self, nbytes: int) -> None:
        """A comm's output is `nbytes` long: slots claimed from now on have room for it."""
        self.placed_bytes += aligned(nbytes)

    def _claim(self) -> GradSlot | None:
        if self.current is None and not self.error:
            try:
                size = HEADER_BYTES + self.placed_bytes + self.rest_bytes
                # memory for the header only: the outputs placed and the rest the snapshot
                # copies take theirs as they come (most of `rest_bytes` is never written)
                self.current = GradSlot(*self.ring.claim(size, used=HEADER_BYTES))
            except (OSError, RuntimeError) as e:  # say /dev/shm is full: reported at take
                self.error = f"{type(e).__name__}: {e}"
        return self.current

    def place(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of this step's slot (uint8, cache-line aligned), or None: no room. A
        storage of its own that starts there, not a slice of the slot's: FSDP views the
        gradients out of an output with `as_strided`, whose offsets count from the start of
        the storage."""
        slot = self._claim()
        if slot is None or slot.used + nbytes > HEADER_BYTES + self.placed_bytes:
            return None
        try:
            self.ring.reserve(slot.bin, slot.used + nbytes)
        except OSError:  # /dev/shm is full: torch's memory, and the copy will say so
            return None
        raw = torch.frombuffer(
            slot.image.numpy(), dtype=torch.uint8, count=nbytes, offset=slot.used
        )
        slot.used = aligned(slot.used + nbytes)
        return raw

    def seal(self) -> GradSlot | str:
        """This step's slot (claimed now if nothing was placed), or why there is none; the
        next step claims the next one."""
        slot, error = self._claim(), self.error
        self.current, self.error = None, ""
        self.epoch += 1
        return slot if slot is not None else error


class SlotReduceScatter(DefaultReduceScatter):
    """FSDP's reduce-scatter, its group's first output of a step in that step's slot."""

    def __init__(self, slots: GradSlots):
        self.slots = slots
        self.numel: int | None = None  # the output's, from the first call
        self.epoch = -1  # the step whose output this comm placed last

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        if device.type == "cpu" and numel == self.numel and self.epoch != self.slots.epoch:
            self.epoch = self.slots.epoch
            raw = self.slots.place(numel * dtype.itemsize)
            if raw is not None:
                return raw.view(dtype).view(*size)
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.numel is None:
            self.numel = output_tensor.numel()
            self.slots.learn(output_tensor.numel() * output_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def reduce_into(parts: list[nn.Module], slots: GradSlots) -> int:
    """Give every FSDP group of `parts` a `SlotReduceScatter`; returns how many got one (a
    module with parameters on several meshes keeps torch's: FSDP allows no custom comm
    there)."""
    n = 0
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                try:
                    m.set_custom_reduce_scatter(SlotReduceScatter(slots))
                    n += 1
                except ValueError:
                    pass
    return n
