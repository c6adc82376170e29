"""Admission at POST /v1/jobs: refuse what can never run here, with the field and the fix.

Checked after the spec itself is valid (services/spec.py):
  - paths: `data.source` and `checkpoint.root` under the configured roots (services/paths.py);
  - quota: the job's ranks within its owner's quota of running ranks (`Quotas`);
  - memory: a first-order per-rank estimate (`rank_memory`) within the largest device of the
    pool (the live registered workers);
  - size: the ranks and spares within the pool's workers whose devices are large enough.
With no live worker there is nothing to judge the last two against (workers may join later):
the job is admitted and waits; the scheduler's backfill keeps it from blocking others.
Torch-free, like the rest of the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from controller.placement import natural_key
from services.paths import confine_spec
from services.spec import JobSpec, Problem, SpecError
from services.store import Store

GiB = 2**30
# Bytes per parameter in training: fp32 weights (4) + grads (4) + Adam's two moments (8).
WEIGHT_B, GRAD_B, ADAM_B = 4, 4, 8
ACT_B = 4  # fp32 activations
RUNTIME_B = 256 * 2**20  # interpreter, torch and the process group, per rank


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


@dataclass(frozen=True)
class PoolWorker:
    wid: str
    devices: int
    memory_bytes: int  # per device
    device_kind: str


@dataclass(frozen=True)
class RankMemory:
    state: int  # weights, grads and optimizer moments held by one rank
    activations: int  # the microbatches in flight on the first pipeline stage

    @property
    def total(self) -> int:
        return self.state + self.activations + RUNTIME_B


def rank_memory(spec: JobSpec) -> RankMemory:
    """First-order bytes one rank needs. The model is split evenly over tp*pp (embedding and
    head ignored); ZeRO 2 shards grads and moments over dp, ZeRO 3 the weights too.
    Activations per layer and microbatch follow Korthikanti et al. (2022), s*b*h*34 bytes at
    16 bits (the model's fused SDPA keeps no s*s scores, so their 5as/h term is left out),
    doubled for fp32 and split over tp; with activation checkpointing only each layer's input
    is kept. 1F1B keeps up to pp microbatches in flight, GPipe all of them."""
    m, p, t = spec.model, spec.parallel, spec.train
    shard = m.params / (p.tp * p.pp)
    if p.zero == 3:
        state = shard * (WEIGHT_B + GRAD_B + ADAM_B) / p.dp
    elif p.zero == 2:
        state = shard * (WEIGHT_B + (GRAD_B + ADAM_B) / p.dp)
    else:
        state = shard * (WEIGHT_B + GRAD_B + ADAM_B)
    s, h, b = m.seq_len, m.d_model, max(1, t.global_batch // (p.dp * p.microbatches))
    layer = s * b * h * 34 * (ACT_B / 2) / p.tp
    stage_layers = m.layers // p.pp
    per_micro = (
        (stage_layers * s * b * h * ACT_B + layer)
        if p.activation_checkpointing
        else stage_layers * layer
    )
    in_flight = p.microbatches if p.pp_schedule == "gpipe" else min(p.pp, p.microbatches)
    return RankMemory(int(state), int(per_micro * in_flight))


def host_memory_per_device(devices: int) -> int:
    """What an agent on this host reports when its registration has no memory_bytes: host RAM
    (MemTotal) shared by its devices."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // max(1, devices)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def live_pool(store: Store, alive_s: float) -> list[PoolWorker]:
    """Every live registered worker, busy or idle (busy ones free up; capacity is what counts)."""
    wids = sorted(store.alive_workers(alive_s), key=natural_key)
    infos = store.workers(wids)
    out = []
    for w in wids:
        info = infos[w]
        if not info.get("joined_at"):  # only workers the controller registered (at join)
            continue
        devices = max(1, int(info.get("devices") or 1))
        memory = int(info.get("memory_bytes") or 0) or host_memory_per_device(devices)
        out.append(PoolWorker(w, devices, memory, info.get("device_kind") or "cpu"))
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def capacity_problems(spec: JobSpec, pool: list[PoolWorker]) -> list[Problem]:
    """Memory and size against the pool; nothing when the pool is empty (nothing to judge)."""
    if not pool:
        return []
    m, p = spec.model, spec.parallel
    need = rank_memory(spec)
    model_field = "model.preset" if m.preset else "model"
    biggest = max(pool, key=lambda w: w.memory_bytes)
    if need.total > biggest.memory_bytes:
        hint = ["raise parallel.tp or parallel.pp"]
        if p.zero != 3:
            hint.append("use parallel.zero: 3")
        hint.append("raise parallel.dp (ZeRO shards the optimizer over it)")
        if not p.activation_checkpointing and need.activations > need.state:
            hint.append("set parallel.activation_checkpointing: true")
        return [
            Problem(
                model_field,
                f"one rank needs about {_gib(need.total)} ({_gib(need.state)} weights, grads "
                f"and Adam moments + {_gib(need.activations)} activations) but the largest "
                f"device in the pool ({biggest.device_kind}, worker {biggest.wid}) has "
                f"{_gib(biggest.memory_bytes)}; " + ", ".join(hint) + ", or choose a smaller model",
            )
        ]
    fit = sorted((w for w in pool if w.memory_bytes >= need.total), key=lambda w: -w.devices)
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
) -> None:
    """Raise SpecError listing every reason `spec` can never run here."""
    problems: list[Problem] = []
    try:
        confine_spec(
            spec.model_dump(mode="json"), cfg.data_roots, cfg.checkpoint_roots, on_host=False
        )
    except SpecError as e:
        problems += e.problems
    problems += quota_problems(spec, owner, quotas)
    problems += capacity_problems(spec, live_pool(store, alive_s))
    if problems:
        raise SpecError(problems)
