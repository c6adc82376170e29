"""The parallelism planner (docs/planner.md): per-rank memory, communication, pipeline bubble
and step time of a layout on a hardware profile, and the search over layouts. Torch-free, so
the controller's admission and the command line use it as they are."""

from services.planner.hardware import (
    FABRICS,
    INFINIBAND,
    PROFILES,
    DeviceProfile,
    Fabric,
    fabric,
    host_memory_per_device,
    profile,
)
from services.planner.layout import Cluster, Layout
from services.planner.search import Plan, evaluate, search
from services.spec import JobSpec


def cluster(
    device: str,
    workers: int,
    devices_per_worker: int,
    memory_per_device: int | None = None,
    fabric: Fabric = INFINIBAND,
) -> Cluster:
    """A cluster of one profile, its hosts joined by `fabric`; `memory_per_device`
    overrides the profile's. A cpu device holds this host's RAM shared by its devices unless
    told otherwise."""
    prof = profile(device)
    memory = memory_per_device or prof.memory_bytes or host_memory_per_device(devices_per_worker)
    if memory <= 0:
        raise ValueError(f"device {device!r} has no fixed memory; give memory_per_device")
    return Cluster(workers, devices_per_worker, prof, memory, fabric)


def report(spec: JobSpec, where: Cluster) -> dict:
    """{"fabric": the one assumed between hosts, "given": the spec's own layout or None under
    parallel.auto, "plans": every feasible plan, best first} as JSON documents (services/api.py
    PlanResult)."""
    given = None if spec.parallel.auto else evaluate(spec, Layout.of(spec.parallel), where)
    return {
        "fabric": where.fabric.name,
        "given": given.to_json() if given else None,
        "plans": [p.to_json() for p in search(spec, where)],
    }


__all__ = [
    "FABRICS",
    "PROFILES",
    "Cluster",
    "DeviceProfile",
    "Fabric",
    "Layout",
    "Plan",
    "cluster",
    "evaluate",
    "fabric",
    "profile",
    "report",
    "search",
]
