"""The experts' matrix products in one call: torch's grouped GEMM over rows grouped by expert,
with the groups' ends in a device tensor (docs/architecture.md, "Experts").

For bf16 on sm90 and sm100 (H100, H200, B200) torch runs it as one CUTLASS kernel that reads the
ends on the device: no host sync and no Python loop over experts. Anywhere else (CPU, fp32, an
older GPU) torch's own fallback reads the ends on the host and runs one `mm` per group
(aten/src/ATen/native/cuda/GroupedBlas.cpp), the products a loop over experts computes.
`torch.nn.functional.grouped_mm` is its public name since torch 2.10, `torch._grouped_mm` the one
before."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
ALIGN_BYTES = 16  # grouped_mm's operands: every stride but the last a multiple of 16 bytes


def takes(*operands: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM accepts these operands: it refuses a row stride that is not
    a multiple of 16 bytes on every device (an fp32 width not divisible by 4, say); the caller
    then computes expert by expert."""
    if GROUPED_MM is None:
        return False
    for t in operands:
        unit = ALIGN_BYTES // t.element_size()
        if t.stride(-1) != 1 or any(s % unit for s in t.stride()[:-1]):
            return False
    return True


def swiglu_experts(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each group of rows of `x` with its expert's weights, (experts, d, hidden) for
    `gate` and `up` and (experts, hidden, d) for `down`; `ends`: int32, the end of each expert's
    rows in `x`."""
    hidden = F.silu(GROUPED_MM(x, gate, offs=ends)) * GROUPED_MM(x, up, offs=ends)
    return GROUPED_MM(hidden, down, offs=ends)
