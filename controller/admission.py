"""Admission at POST /v1/jobs: refuse what can never run here, with the field and the fix.

Checked after the spec itself is valid (services/spec.py):
  - paths: `data.source` and `checkpoint.root` under the configured roots (services/paths.py);
  - quota: the job's ranks within its owner's quota of running ranks (`Quotas`);
  - memory: the planner's per-rank peak (services/planner, docs/planner.md) within the largest
    device of the pool (the live registered workers); a refusal names the nearest layout that
    fits;
  - size: the ranks and spares within the pool's workers whose devices are large enough;
  - snapshots: a worker's share of the job's in-memory snapshot rings within the room some
    worker of the pool registered for them (services/planner/snapshot_memory.py).
With no live worker there is nothing to judge the last two against (workers may join later):
the job is admitted and waits; the scheduler's backfill keeps it from blocking others.
`parallel.auto` specs get the planner's best layout for the live pool first.
Torch-free, like the rest of the controller.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from pathlib import Path

from controller.placement import natural_key
from dataset.format import MANIFEST
from services import planner
from services.dataset_admission import check_dataset
from services.paths import confine_spec
from services.planner import Cluster, Layout
from services.planner.hardware import INFINIBAND, TCP, Fabric, host_memory_per_device
from services.planner.search import candidates
from services.planner.snapshot_memory import snapshot_rings
from services.spec import JobSpec, Problem, SpecError
from services.store import Store

GiB = 2**30


@dataclass(frozen=True)
class Quotas:
    """Running ranks per owner (dp*pp*tp of its started jobs; spares do not count).
    `default` applies to owners not listed; None: unlimited."""

    default: int | None = None
    owners: dict[str, int] = field(default_factory=dict)

    def limit(self, owner: str | None) -> int | None:
        return self.owners.get(owner or "", self.default)


@dataclass(frozen=True)
class AdmissionConfig:
    data_roots: tuple[Path, ...] = ()  # controller --data-root
    checkpoint_roots: tuple[Path, ...] = ()  # controller --checkpoint-root-allow
    allow_chaos: bool = False  # controller --allow-chaos (controller/chaos_gate.py)


@dataclass(frozen=True)
class PoolWorker:
    wid: str
    devices: int
    memory_bytes: int  # per device
    device_kind: str
    fabric: str = "infiniband"  # what its host reaches other hosts over (its join)
    snapshot_bytes: int = 0  # the room for in-memory snapshots it registered; 0: unknown


def live_pool(store: Store, alive_s: float) -> list[PoolWorker]:
    """Every live registered worker, busy or idle (busy ones free up; capacity is what counts).
    Only workers registered at a join count; their join-time fields are all it reads."""
    wids = sorted(store.alive_workers(alive_s), key=natural_key)
    infos = store.registrations(wids)
    return pool_of({w: infos[w] for w in wids if w in infos})


def pool_of(infos: dict[str, dict[str, str]]) -> list[PoolWorker]:
    """The workers of these registrations (join-time fields), in their order."""
    return [
        _pool_worker(
            w,
            i.get("devices"),
            i.get("memory_bytes"),
            i.get("device_kind"),
            i.get("fabric"),
            i.get("snapshot_bytes"),
        )
        for w, i in infos.items()
    ]


@functools.lru_cache(maxsize=1 << 16)  # built once per registration, not per submission
def _pool_worker(
    wid: str,
    devices: str | None,
    memory: str | None,
    kind: str | None,
    fabric: str | None,
    snapshot: str | None,
) -> PoolWorker:
    n = max(1, int(devices or 1))
    memory_bytes = int(memory or 0) or host_memory_per_device(n)
    return PoolWorker(
        wid, n, memory_bytes, kind or "cpu", fabric or INFINIBAND.name, int(snapshot or 0)
    )


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def pool_cluster(
    pool: list[PoolWorker], max_ranks: int | None = None, fabric: Fabric | None = None
) -> Cluster:
    """The pool as the planner sees it: its workers at the smallest device count and memory
    among them (a plan that fits those fits every worker), joined by `fabric`, by default the
    slowest any of them joined with (docs/planner.md, "Fabrics"). A `cuda` worker is costed as an
    H200 when its devices hold more than 100 GB, else as an H100: admission judges memory, and
    those profiles differ from the A100's only in speed."""
    devices = min(w.devices for w in pool)
    memory = min(w.memory_bytes for w in pool)
    kinds = {w.device_kind for w in pool}
    name = "cpu" if kinds == {"cpu"} else "h200-141gb" if memory > 100e9 else "h100-80gb"
    workers = len(pool)
    if max_ranks is not None:
        workers = max(1, min(workers, max_ranks // devices))
    if fabric is None:
        fabric = TCP if any(w.fabric == TCP.name for w in pool) else INFINIBAND
    return planner.cluster(name, workers, devices, memory, fabric)


def _plan(spec: JobSpec, pool: list[PoolWorker]) -> planner.Plan:
    """The spec's own layout, costed on the pool (every worker taken as one host)."""
    return planner.evaluate(spec, Layout.of(spec.parallel), pool_cluster(pool))


def nearest(spec: JobSpec, plans: list[planner.Plan]) -> planner.Plan | None:
    """The feasible plan that changes the fewest of the spec's parallel fields (then the
    fastest): what the user most likely meant."""
    given = asdict(Layout.of(spec.parallel))

    def changed(plan: planner.Plan) -> int:
        return sum(given[k] != v for k, v in asdict(plan.layout).items())

    return min(plans, key=lambda p: (changed(p), p.cost.step_time_s), default=None)


def _suggest(spec: JobSpec, pool: list[PoolWorker]) -> str:
    spares = spec.fault_tolerance.spares
    usable = pool[: max(1, len(pool) - spares)]
    try:
        best = nearest(spec, planner.search(spec, pool_cluster(usable)))
    except SpecError:  # too many layouts to weigh: the refusal stands without a suggestion
        return "too many layouts to suggest one"
    if best is None:
        return "no layout of this model fits the pool"
    return f"the nearest layout that fits: parallel: {_parallel_yaml(best.layout)}"


def _parallel_yaml(layout: Layout) -> str:
    fields = ", ".join(f"{k}: {str(v).lower()}" for k, v in asdict(layout).items())
    return "{" + fields + "}"


def capacity_problems(spec: JobSpec, pool: list[PoolWorker]) -> list[Problem]:
    """Memory (the planner's model, docs/planner.md) and size against the pool; nothing when
    the pool is empty (nothing to judge)."""
    if not pool:
        return []
    m, p = spec.model, spec.parallel
    biggest = max(pool, key=lambda w: w.memory_bytes)
    plan = _plan(spec, [biggest])
    need, have = plan.memory, plan.capacity_bytes
    model_field = "model.preset" if m.preset else "model"
    if need.total > have:
        state = need.params + need.grads + need.optimizer + need.gathered
        hint = ["raise parallel.tp or parallel.pp"]
        if p.zero != 3:
            hint.append("use parallel.zero: 3")
        hint.append("raise parallel.dp (ZeRO shards the optimizer over it)")
        if p.activation_checkpointing is not True and need.activations > state:
            hint.append(
                'set parallel.activation_checkpointing: "selective" (or true, the least memory)'
                if not p.activation_checkpointing
                else "set parallel.activation_checkpointing: true (the least memory)"
            )
        return [
            Problem(
                model_field,
                f"one rank needs about {_gib(need.total)} ({_gib(state)} weights, grads and "
                f"Adam moments + {_gib(need.activations)} activations + "
                f"{_gib(need.buffers + need.runtime)} buffers and runtime) but the largest "
                f"device in the pool ({biggest.device_kind}, worker {biggest.wid}) has "
                f"{_gib(have)}; "
                + ", ".join(hint)
                + ", or choose a smaller model; "
                + _suggest(spec, pool),
            )
        ]
    fit = sorted(
        (w for w in pool if w.memory_bytes >= need.total), key=lambda w: (-w.devices, w.wid)
    )
    ranks, spares = p.world_size, spec.fault_tolerance.spares
    used = slots = 0
    for w in fit:
        if slots >= ranks:
            break
        used, slots = used + 1, slots + w.devices
    if slots < ranks or used + spares > len(fit):
        dev = sum(w.devices for w in fit)
        field_ = "fault_tolerance.spares" if slots >= ranks and spares else "parallel.dp"
        return [
            Problem(
                field_,
                f"dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = {ranks} ranks + {spares} spare workers "
                f"need more than the pool has: {len(fit)} live workers ({dev} devices) with "
                f"room for a rank; lower parallel.dp (or fault_tolerance.spares), or add workers",
            )
        ]
    return []


def snapshot_problems(spec: JobSpec, pool: list[PoolWorker]) -> list[Problem]:
    """The job's snapshot rings against the room the workers registered for them: refused when
    no worker could hold its share (its devices' ranks, at most the world); nothing when the
    job takes no snapshots or no worker said how much room it has."""
    known = [w for w in pool if w.snapshot_bytes]
    if not spec.snapshot.enabled or not known:
        return []
    rings = snapshot_rings(spec, _plan(spec, [max(pool, key=lambda w: w.memory_bytes)]).memory)
    world = spec.parallel.world_size

    def need(w: PoolWorker) -> int:
        return min(w.devices, world) * rings.per_rank

    if any(need(w) <= w.snapshot_bytes for w in known):
        return []
    roomiest = max(known, key=lambda w: w.snapshot_bytes / need(w))
    s = spec.snapshot
    hint = ["lower snapshot.keep (at least 2)"] if s.keep > 2 else []
    if rings.logged_slots:
        hint.append("set snapshot.full_every: 1 (no logged steps)")
    if s.buddy:
        hint.append("set snapshot.buddy: false (no copies of other ranks)")
    if spec.parallel.zero != 3:
        hint.append("use parallel.zero: 3 with a larger parallel.dp (smaller shards)")
    return [
        Problem(
            "snapshot",
            f"the in-memory snapshots need about {_gib(need(roomiest))} on a worker "
            f"({rings.explain(min(roomiest.devices, world))}) but the most room any worker "
            f"has for them is {_gib(roomiest.snapshot_bytes)} (worker {roomiest.wid}, its "
            "--snapshot-dir); "
            + ", ".join(hint)
            + ", give the agents a larger --snapshot-dir, or set snapshot.enabled: false "
            "(recoveries then restore from the last disk checkpoint)",
        )
    ]


def auto_layout(spec: JobSpec, pool: list[PoolWorker], max_ranks: int | None) -> JobSpec:
    """`parallel.auto`: the spec with the planner's best layout for the live pool, keeping
    the workers its spares need free (docs/planner.md, "Admission")."""
    spares = spec.fault_tolerance.spares
    if len(pool) <= spares:
        raise SpecError(
            [
                Problem(
                    "parallel.auto",
                    f"the planner needs live workers to plan against: {len(pool)} live, "
                    f"{spares} kept as spares; add workers or lower fault_tolerance.spares",
                )
            ]
        )
    usable = sorted(pool, key=lambda w: (-w.memory_bytes, w.wid))[: len(pool) - spares]
    cluster = pool_cluster(usable, max_ranks)
    plans = planner.search(spec, cluster)
    if not plans:
        smallest = min(
            (planner.evaluate(spec, lay, cluster) for lay in candidates(spec, cluster)),
            key=lambda p: p.memory.total,
            default=None,
        )
        need = f"; the smallest layout needs {_gib(smallest.memory.total)}" if smallest else ""
        raise SpecError(
            [
                Problem(
                    "model.preset" if spec.model.preset else "model",
                    f"no layout fits {len(usable)} workers of {_gib(cluster.memory_per_device)} "
                    f"per device{need}; choose a smaller model or add workers",
                )
            ]
        )
    best = plans[0].layout
    min_dp = min(spec.fault_tolerance.min_dp, best.dp)
    return spec.model_copy(
        update={
            "parallel": best.parallel(spec.parallel),
            "fault_tolerance": spec.fault_tolerance.model_copy(update={"min_dp": min_dp}),
        }
    )


def quota_problems(spec: JobSpec, owner: str | None, quotas: Quotas) -> list[Problem]:
    limit = quotas.limit(owner)
    ranks = spec.parallel.world_size
    if limit is not None and ranks > limit:
        return [
            Problem(
                "parallel.dp",
                f"{ranks} ranks exceed the quota of {owner or 'anonymous'} "
                f"({limit} running ranks); lower parallel.dp, pp or tp, or "
                "ask the operator for a larger --quota",
            )
        ]
    return []


def admit(
    spec: JobSpec,
    owner: str | None,
    store: Store,
    cfg: AdmissionConfig,
    quotas: Quotas,
    alive_s: float,
) -> JobSpec:
    """The spec to store (with `parallel.auto`, the planned one); SpecError listing every
    reason it can never run here."""
    problems: list[Problem] = []
    try:
        confined = confine_spec(
            spec.model_dump(mode="json"), cfg.data_roots, cfg.checkpoint_roots, on_host=False
        )
        # a dataset the controller can read is checked now; one only the agents mount, by them
        source = confined["data"]["source"]
        if spec.data.kind == "dataset" and (Path(source.partition(":")[2]) / MANIFEST).is_file():
            check_dataset(
                spec.model_copy(update={"data": spec.data.model_copy(update={"source": source})})
            )
    except SpecError as e:
        problems += e.problems
    pool = live_pool(store, alive_s)
    if spec.parallel.auto and not problems:
        spec = auto_layout(spec, pool, quotas.limit(owner))
    problems += quota_problems(spec, owner, quotas)
    problems += capacity_problems(spec, pool)
    if not problems:
        problems += snapshot_problems(spec, pool)
    if problems:
        raise SpecError(problems)
    return spec
