"""Every layout a spec can run with on a cluster, costed and ranked (docs/planner.md, "Search").

Candidates obey the same divisibility rules as services/spec.py (heads and ffn by tp, vocab
too with loss_parallel, layers by pp*v, the batch by dp*M, M >= pp, M divisible by pp for
interleaving) and the topology rule: a TP group lies inside one host, so tp divides the
devices per worker; PP, then DP, cross hosts. A plan is feasible when its worst rank fits the
usable memory of a device; feasible plans rank by estimated step time, then memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from services.planner.cost import StepCost, step_cost
from services.planner.layout import Cluster, Layout
from services.planner.memory import MemoryAnatomy, rank_memory
from services.planner.snapshot_memory import snapshot_rings
from services.spec import JobSpec, Problem, SpecError

GiB = 2**30
# Bounds one search (seconds at most): Llama 3 405B on 16,384 GPUs weighs 34,384 layouts
MAX_CANDIDATES = 60_000


def divisors(n: int) -> list[int]:
    """Ascending; O(sqrt n), since a batch may be 10**7 (an API caller's choice)."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryAnatomy
    cost: StepCost
    capacity_bytes: int  # usable bytes of one device
    problems: tuple[str, ...]  # why it cannot run; empty when feasible
    snapshot_bytes: int  # host memory the rank's snapshot rings take at the peak (`ring_bytes`)

    @property
    def feasible(self) -> bool:
        return not self.problems

    def explain(self) -> str:
        mem, cap = self.memory, self.capacity_bytes
        state = mem.params + mem.grads + mem.optimizer
        fit = (
            f"fits: {mem.total / GiB:.2f} of {cap / GiB:.2f} GiB on the {mem.position} "
            "pipeline rank"
            if self.feasible
            else "does not fit: " + "; ".join(self.problems)
        )
        biggest = max(
            ("weights, grads and Adam", state),
            ("gathered weights", mem.gathered),
            ("activations", mem.activations),
            ("buffers", mem.buffers),
            ("runtime", mem.runtime),
            key=lambda kv: kv[1],
        )
        share = getattr(self.cost, _PART_FIELD[self.cost.dominant()])
        return (
            f"{fit} (largest: {biggest[0]} {biggest[1] / GiB:.2f} GiB); "
            f"step dominated by {self.cost.dominant()} "
            f"({share / self.cost.step_time_s:.0%} of {self.cost.step_time_s:.3g} s)"
        )

    def to_json(self) -> dict:
        lay, c = self.layout, self.cost
        return {
            "dp": lay.dp,
            "pp": lay.pp,
            "tp": lay.tp,
            "zero": lay.zero,
            "microbatches": lay.microbatches,
            "virtual_stages": lay.virtual_stages,
            "pp_schedule": lay.pp_schedule,
            "activation_checkpointing": lay.activation_checkpointing,
            "memory_per_rank_bytes": self.memory.total,
            "memory": {
                k: getattr(self.memory, k)
                for k in (
                    "params",
                    "grads",
                    "optimizer",
                    "gathered",
                    "activations",
                    "buffers",
                    "runtime",
                )
            },
            "capacity_bytes": self.capacity_bytes,
            "snapshot_per_rank_bytes": self.snapshot_bytes,
            "step_time_s": c.step_time_s,
            "bubble": c.bubble,
            "time": {
                "compute_s": c.compute_s,
                "bubble_s": c.bubble_s,
                "tp_s": c.tp_s,
                "pp_s": c.pp_s,
                "dp_s": c.dp_s,
                "optimizer_s": c.optimizer_s,
            },
            "comm_bytes": {"tp": c.tp_bytes, "pp": c.pp_bytes, "dp": c.dp_bytes},
            "feasible": self.feasible,
            "problems": list(self.problems),
            "explanation": self.explain(),
        }


_PART_FIELD = {
    "compute": "compute_s",
    "pipeline bubble": "bubble_s",
    "TP communication": "tp_s",
    "PP communication": "pp_s",
    "DP communication": "dp_s",
    "optimizer step": "optimizer_s",
}


def layout_problems(spec: JobSpec, layout: Layout, cluster: Cluster) -> list[str]:
    """Why `layout` cannot run `spec` on `cluster` beyond memory (topology and size)."""
    out = []
    if layout.world > cluster.devices:
        out.append(
            f"dp*pp*tp = {layout.world} ranks exceed the {cluster.devices} devices "
            f"({cluster.workers} workers x {cluster.devices_per_worker})"
        )
    if cluster.devices_per_worker % layout.tp:
        out.append(
            f"tp {layout.tp} does not divide the {cluster.devices_per_worker} devices of a "
            "worker: a TP group must stay inside one host"
        )
    return out


def evaluate(spec: JobSpec, layout: Layout, cluster: Cluster) -> Plan:
    """Cost one layout; memory beyond the device is reported in `problems`."""
    memory = rank_memory(spec, layout, cluster)
    capacity = int(cluster.memory_per_device * cluster.device.usable_fraction)
    problems = layout_problems(spec, layout, cluster)
    if memory.total > capacity:
        problems.append(
            f"the {memory.position} pipeline rank needs {memory.total / GiB:.2f} GiB, "
            f"more than the {capacity / GiB:.2f} GiB usable on a {cluster.device.name} device"
        )
    return Plan(
        layout,
        memory,
        step_cost(spec, layout, cluster),
        capacity,
        tuple(problems),
        ring_bytes(spec, memory),
    )


def ring_bytes(spec: JobSpec, memory: MemoryAnatomy) -> int:
    """The host memory of the snapshot rings of the rank whose anatomy is `memory`; 0 without
    snapshots."""
    rings = snapshot_rings(spec, memory)
    return rings.per_rank if rings else 0


def _schedules(pp: int, microbatches: int, stage_layers: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    yield "gpipe", 1
    yield "1f1b", 1
    if microbatches % pp == 0:
        for v in divisors(stage_layers)[1:]:
            yield "interleaved_1f1b", v


def candidates(spec: JobSpec, cluster: Cluster) -> Iterator[Layout]:
    """Every layout the spec's own checks accept and the topology allows."""
    m, batch = spec.model, spec.train.global_batch
    for tp in divisors(cluster.devices_per_worker):
        if m.heads % tp or m.key_value_heads % tp or m.ffn % tp:
            continue
        if spec.parallel.loss_parallel and m.vocab % tp:
            continue
        if m.tie_embeddings and tp > 1 and not spec.parallel.loss_parallel:
            continue
        for pp in divisors(m.layers):
            if pp * tp > cluster.devices:
                break
            for dp in divisors(batch):
                if dp * pp * tp > cluster.devices:
                    break
                for mb in divisors(batch // dp):
                    if mb < pp:
                        continue
                    for sched, v in _schedules(pp, mb, m.layers // pp):
                        for zero in (0, 2, 3) if dp > 1 else (0,):
                            for ac in (False, "selective", True):
                                yield Layout(dp, pp, tp, zero, mb, v, ac, sched)


def search(spec: JobSpec, cluster: Cluster) -> list[Plan]:
    """Every feasible plan, best (fastest, then smallest) first. Memory is checked before the
    step is costed: most candidates of a large model do not fit, and costing is the dearer half.
    SpecError when there are more than MAX_CANDIDATES layouts to weigh."""
    capacity = int(cluster.memory_per_device * cluster.device.usable_fraction)
    layouts = list(itertools.islice(candidates(spec, cluster), MAX_CANDIDATES + 1))
    if len(layouts) > MAX_CANDIDATES:
        raise SpecError(
            [
                Problem(
                    "train.global_batch",
                    f"more than {MAX_CANDIDATES} layouts to weigh on {cluster.devices} "
                    "devices; plan for fewer workers, or a global batch with fewer divisors",
                )
            ]
        )
    plans = []
    for lay in layouts:
        memory = rank_memory(spec, lay, cluster)
        if memory.total <= capacity:
            cost = step_cost(spec, lay, cluster)
            plans.append(Plan(lay, memory, cost, capacity, (), ring_bytes(spec, memory)))
    return sorted(plans, key=lambda p: (p.cost.step_time_s, p.memory.total))
