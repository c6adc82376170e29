"""The GPUs a worker may use, and which one each of its ranks gets.

Discovery goes through NVML (nvidia-ml-py), not torch: the agent never imports torch (a warm
trainer pays that import, the agent does not), and NVML answers without creating a CUDA
context. NVML numbers every GPU of the host; CUDA numbers only those `CUDA_VISIBLE_DEVICES`
lets through, in the order it lists them, so a trainer's `cuda:<i>` is the i-th GPU of that
list. `visible_ordinals` applies the variable exactly as torch does for
`torch.cuda.device_count()` (torch/cuda/__init__.py, `_parse_visible_devices` and
`_transform_uuid_to_ordinals`), so the agent's count and the trainer's agree:
- unset: every GPU; set but empty: none;
- indices (`0,2`), parsed like strtoul (`1gpu` is 1); the first entry that is not a valid
  index, or not below the host's GPU count, ends the list;
- GPU UUIDs (`GPU-8f3c...`), each a unique prefix of one GPU's UUID; the first that matches
  none, or several, ends the list;
- the same GPU listed twice: no GPU at all;
- MIG instances (`MIG-...`) are not supported: no GPU, and a warning.
No NVML library, no driver, or no GPU: zero GPUs, and the worker runs the CPU path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("meshkeeper.devices")


@dataclass(frozen=True)
class Gpu:
    cuda_index: int  # the trainer's `cuda:<i>`: its position in CUDA_VISIBLE_DEVICES' order
    nvml_index: int  # its place among every GPU of the host (what nvidia-smi shows)
    uuid: str
    memory_bytes: int
    name: str = ""  # NVML's product name ("NVIDIA H100 80GB HBM3"): the MFU's datasheet peak


def _leading_int(text: str) -> int:
    """strtoul's reading of an entry: its leading digits, or -1 when there are none."""
    digits = len(text) - len(text.lstrip("0123456789"))
    return int(text[:digits]) if digits else -1


def _by_uuid_prefix(prefix: str, uuids: list[str]) -> int:
    matches = [i for i, u in enumerate(uuids) if u.startswith(prefix)]
    return matches[0] if len(matches) == 1 else -1


def visible_ordinals(cuda_visible: str | None, uuids: list[str]) -> list[int]:
    """The NVML indices of the GPUs CUDA exposes, in CUDA's order (`cuda:0` first), given
    `CUDA_VISIBLE_DEVICES` and every GPU's UUID in NVML order."""
    if cuda_visible is None:
        return list(range(len(uuids)))
    entries = [e.strip() for e in cuda_visible.split(",")]
    if entries[0].startswith("MIG-"):
        log.warning("CUDA_VISIBLE_DEVICES names MIG instances, which meshkeeper cannot place")
        return []
    by_uuid = entries[0].startswith("GPU-")
    out: list[int] = []
    for e in entries:
        if by_uuid:
            i = _by_uuid_prefix(e, uuids) if e.startswith("GPU-") else -1
        else:
            i = _leading_int(e)
            i = i if i < len(uuids) else -1
        if i < 0:
            break
        if i in out:
            return []
        out.append(i)
    return out


def discover(environ: dict[str, str] | None = None) -> list[Gpu]:
    """The GPUs this process's CUDA would see, in CUDA's order; [] without NVML or a driver."""
    import pynvml  # nvidia-ml-py: imported here so a worker without it still runs on CPU

    env = os.environ if environ is None else environ
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # no libnvidia-ml, no driver loaded: the CPU path
        log.debug("NVML unavailable (%s): no GPUs", e)
        return []
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        return [
            Gpu(
                cuda,
                nvml,
                uuids[nvml],
                int(pynvml.nvmlDeviceGetMemoryInfo(handles[nvml]).total),
                _text(pynvml.nvmlDeviceGetName(handles[nvml])),
            )
            for cuda, nvml in enumerate(visible_ordinals(env.get("CUDA_VISIBLE_DEVICES"), uuids))
        ]
    except pynvml.NVMLError as e:
        log.warning("NVML failed while listing GPUs (%s): running on CPU", e)
        return []
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older bindings return bytes


def device_indices(slots: dict[int, int], devices: int) -> dict[int, int]:
    """Rank -> the device index it gets on this worker, from rank -> assigned slot (the
    assignment's `local_rank`), re-derived at every launch from the slots this worker holds in
    the generation and its own device count (docs/architecture.md, "Parts", "Agent").

    Slots that are distinct and below `devices` are kept, so the controller's choice stands;
    otherwise (a slot numbered for another worker, as a rank moved by a replacement used to
    carry) the ranks take devices 0, 1, ... in (slot, rank) order. More ranks than devices
    cannot run here."""
    if len(slots) > devices:
        raise ValueError(
            f"{len(slots)} ranks assigned to a worker with {devices} device(s); "
            "start the agent with --devices at most its GPU count, and place by it"
        )
    if len(set(slots.values())) == len(slots) and all(0 <= s < devices for s in slots.values()):
        return dict(slots)
    order = sorted(slots, key=lambda r: (slots[r], r))
    return {r: i for i, r in enumerate(order)}
