"""Model FLOPs utilisation, computed in the agent without importing torch.

`worker.trainer.model.flops_per_token` counts parameters on a meta-device model, which needs
torch; the agent must not import it (~4 s and hundreds of MB per agent; docs/architecture.md,
"Parts"). The count below follows the same architecture analytically, and tests/observability
checks it equals `worker.trainer.model.flops_per_token` for every preset, so the two cannot
drift apart.
"""

from __future__ import annotations

import os

from services.planner.hardware import profile, profile_of_device
from services.spec import ModelSpec

# One CPU core's fp32 peak, roughly: 2 FMA units x 8 lanes (AVX2) x 2 FLOPs x ~3 GHz.
CPU_CORE_PEAK_FLOPS = 1e11


def param_count(m: ModelSpec) -> int:
    """The spec's analytic count (`ModelSpec.params`, shared with the controller's admission)."""
    return m.params


def flops_per_token(m: ModelSpec) -> float:
    """Training FLOPs per token: 6N plus attention scores (PaLM appendix B); N is the spec's
    analytic count of the parameters a token runs through (`ModelSpec.active_params`: top_k
    of a mixture's experts)."""
    return 6 * m.active_params + 12 * m.layers * m.d_model * m.seq_len


def default_peak_flops(devices: int) -> float:
    """Peak FLOP/s of one rank on a CPU host: its share of the cores."""
    return CPU_CORE_PEAK_FLOPS * max(1, (os.cpu_count() or 1) // max(1, devices))


def device_peak_flops(device_name: str | None, precision: str) -> float | None:
    """The datasheet's dense peak of a GPU that NVML calls `device_name`, at the job's
    precision (services/planner/hardware.py); None for a CPU or a model without a profile."""
    found = profile_of_device(device_name) if device_name else None
    return profile(found).flops[precision] if found else None


def mfu(flops_per_tok: float, tokens_per_s: float, world_size: int, peak_flops: float) -> float:
    """The job's tokens/s is global: each rank does 1/world of the work against its own peak."""
    return flops_per_tok * tokens_per_s / max(1, world_size) / peak_flops
