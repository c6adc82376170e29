"""Which exceptions a rank reads as its device failing (worker/trainer/device_fault.py): torch's
AcceleratorError, or an older torch's plain "CUDA error:" RuntimeError; an allocator's
out-of-memory and ordinary errors are not."""

from __future__ import annotations

import pytest
import torch

from worker.trainer.device_fault import explain_fault, is_device_fault


@pytest.mark.parametrize(
    ("error", "device_fault"),
    [
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("shape mismatch"), False),
        (ValueError("CUDA error: not a runtime error"), False),
    ],
)
def test_only_a_cuda_error_is_a_device_fault(error, device_fault):
    assert is_device_fault(error) is device_fault


def test_the_message_names_the_device_the_error_and_what_happens_next():
    e = torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nmore")
    msg = str(explain_fault(e, torch.device("cuda", 3)))
    assert msg.startswith(
        "device error on cuda:3 (CUDA error: an illegal memory access was encountered). "
    ), msg
    assert "replaced and quarantined" in msg and "model.vocab" in msg, msg
