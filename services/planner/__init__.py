"""The parallelism planner (docs/planner.md): per-rank memory, communication, pipeline bubble
and step time of a layout on a hardware profile, and the search over layouts. Torch-free, so
the controller's admission and the command line use it as they are."""

from services.planner.hardware import PROFILES, DeviceProfile, profile
from services.planner.layout import Cluster, Layout
from services.planner.search import Plan, evaluate, search


def cluster(
    device: str, workers: int, devices_per_worker: int, memory_per_device: int | None = None
) -> Cluster:
    """A cluster of one profile; `memory_per_device` overrides the profile's (cpu has none)."""
    prof = profile(device)
    memory = memory_per_device or prof.memory_bytes
    if memory <= 0:
        raise ValueError(f"device {device!r} has no fixed memory; give memory_per_device")
    return Cluster(workers, devices_per_worker, prof, memory)


__all__ = [
    "PROFILES",
    "Cluster",
    "DeviceProfile",
    "Layout",
    "Plan",
    "cluster",
    "evaluate",
    "profile",
    "search",
]
