"""Re-planning on shrink (docs/planner.md, "Re-planning on shrink"): a fault that leaves a job
no spare, where dp cannot drop (below `min_dp`, or a global batch the smaller dp does not
split), used to stop the job until workers came back. Instead the planner now picks the
fastest layout the job's own healthy workers can run, another pp or tp for example, and the
job goes on from its last checkpoint, which DCP reshards to any dp, pp and tp (keyed by FQN;
tests/checkpoint/test_resume.py).

Only what a generation can change is re-planned: dp, pp, tp and microbatches (what an
assignment carries, `Assignment.effective_spec`). zero, the pipeline schedule, virtual
stages and activation checkpointing stay the spec's, dp stays at least `min_dp`, and jobs
with experts split over ep keep waiting (their replicas go in groups of ep).
"""

from __future__ import annotations

from controller.admission import pool_cluster, pool_of
from controller.placement import FreeWorker, place
from controller.recovery import Layout, with_local_world
from services import planner
from services.mesh import MeshShape
from services.spec import JobSpec, SpecError


def switchable(spec: JobSpec, lay: planner.Layout) -> bool:
    """Whether a running job can move to `lay` by a new generation alone."""
    p = spec.parallel
    if lay.activation_checkpointing != p.activation_checkpointing:
        return False
    if lay.zero != p.zero and lay.dp > 1:  # one replica shards nothing: the planner says 0
        return False
    if lay.dp < spec.fault_tolerance.min_dp:
        return False
    if lay.pp == 1:  # no pipeline: the schedule is moot, unless it splits stages further
        return p.virtual_stages == 1
    return (lay.pp_schedule, lay.virtual_stages) == (p.pp_schedule, p.virtual_stages)


def replan(spec: JobSpec, healthy: list[FreeWorker], cluster: planner.Cluster) -> Layout | None:
    """The fastest switchable plan that fits `cluster` (the healthy workers as the planner
    sees them), placed on `healthy` in their order (the job's ranks first); the workers it
    leaves over stay the job's spares. None when nothing fits."""
    if spec.parallel.ep > 1:
        return None
    try:
        plans = planner.search(spec, cluster)
    except SpecError:  # too many layouts to weigh: the job waits, as before
        return None
    host_of = {w.wid: w.host for w in healthy}
    for plan in plans:
        lay = plan.layout
        if not switchable(spec, lay):
            continue
        shape = MeshShape(lay.dp, lay.pp, lay.tp)
        placed = place(shape, 0, healthy)
        if placed is None:
            continue
        used = {r.wid for r in placed.ranks}
        spares = [w.wid for w in healthy if w.wid not in used]
        return Layout(shape, with_local_world(placed.ranks, host_of), lay.microbatches, {}, spares)
    return None


def cluster_of(infos: dict[str, dict[str, str]]) -> planner.Cluster:
    """The planner's view of these workers from their registrations (admission's rules: the
    smallest device count and memory among them)."""
    return pool_cluster(pool_of(infos))


def submitted(spec: JobSpec, workers: list[FreeWorker], host_of: dict[str, str]) -> Layout | None:
    """The spec's own layout (dp, pp, tp, microbatches) placed on `workers` in their order,
    or None when they do not hold it: where a re-planned job grows back to (controller/
    faults.py, `grow_back`). The spares are the caller's to name."""
    p = spec.parallel
    shape = MeshShape(p.dp, p.pp, p.tp)
    placed = place(shape, 0, workers)
    if placed is None:
        return None
    return Layout(shape, with_local_world(placed.ranks, host_of), p.microbatches, {}, [])
