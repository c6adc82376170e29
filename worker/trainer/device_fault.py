"""A rank whose device failed exits with `EXIT_DEVICE` (services/records.py) and a message
naming the device and the error. A CUDA error (an illegal address, an uncorrectable ECC error,
a device that fell off the bus) leaves the process's CUDA context unusable, so the rank cannot
take the next generation in place; the controller blames its worker, replaces it with a spare
and quarantines it until its health probe passes (controller/health.py `device_errors`). The
agent adds what NVML says about the device (worker/agent/device_health.py). The same error at
the same step on the worker that replaced it is the job's own fault (a device-side assert from
a bad index): the job fails instead of spending every spare on it (controller/faults.py
`job_fault`)."""

from __future__ import annotations

import torch


class DeviceFault(RuntimeError):
    """The rank's device failed; the message is for the job's user."""


# torch's error for a failed accelerator call (c10::AcceleratorError, raised for every CUDA
# error but an allocation's, which is torch.OutOfMemoryError), since torch 2.8; before, a
# RuntimeError whose message starts "CUDA error:"
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)


def is_device_fault(e: BaseException) -> bool:
    if _ACCELERATOR_ERROR is not None and isinstance(e, _ACCELERATOR_ERROR):
        return True
    return type(e) is RuntimeError and str(e).lstrip().startswith("CUDA error:")


def explain_fault(e: BaseException, device: torch.device) -> DeviceFault:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return DeviceFault(
        f"device error on {device} ({first}). This worker is replaced "
        "and quarantined until its health probe passes; if the same step fails again on "
        "another device, the job's own input is the cause (a token id at or past "
        "model.vocab, an index out of range), and the job fails"
    )
