"""Silent data corruption: DP replicas compare fingerprints of their state, and a mismatch is
blamed by replaying the steps since the newest checked snapshot (docs/architecture.md,
"Silent data corruption").

Replicas of a layout without ZeRO sharding (the ranks with the same pp and tp coordinates)
hold bitwise-identical parameters and optimizer state after every step. Every
`sdc.every_steps` steps each rank sums every state tensor's machine words as integers (one
flipped bit changes that sum by a power of two, so it never cancels) and the replicas
all-gather the sums. A disagreement names the tensor, the step and the ranks.

Two replicas cannot outvote each other, so every rank replays the steps since the newest
checked snapshot (its own, in host memory) with the same batches, and compares its parameters
after each replayed step with the fingerprint it kept of that step (a local sum every step, no
collective). Replays are deterministic, so the corrupted rank's parameters leave the clean
trajectory first: a corruption reaches its replicas only through the next gradient reduction,
one step later. When no parameter left it (an optimizer-state flip found before the next
update), the rank whose whole state differs from its replay is blamed. A fault that repeats on
replay blames nobody by replay; three or more replicas then fall back to the majority. So does
a replay that reproduces no rank's history (`blame`): on a GPU the training's backward is not
deterministic, and every replica would otherwise be blamed for it.

Such a replay still names the rank by distance (`drifted`). The replicas' histories are
bitwise equal until the corruption, and so are their replays (one reduction serves them all,
and the update is elementwise), so their distances from the replay, each rank's own, are
equal floats until the step the corruption hit. There the corrupted rank's jumps by the
corruption, while its replicas' stays at the noise of a re-execution; it is blamed when its
distance is many times the smallest, nobody otherwise. The distance is read from one float64
sum per parameter tensor, kept every step beside the fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from services.spec import JobSpec, has_replicas
from worker.trainer.parallel import RankContext
from worker.trainer.snapshot_state import _local

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SilentCorruption(RuntimeError):
    """Raised on every rank of the world with the same evidence (RankReport.sdc's shape), or,
    `alone`, on the one rank that found its own state changed (worker/trainer/at_rest.py):
    its peers are in a collective it will never join, so it must not wait for them."""

    def __init__(self, evidence: dict, alone: bool = False):
        super().__init__(evidence["detail"])
        self.evidence, self.alone = evidence, alone


def state_tensors(
    parts: list[nn.Module], optimizers: list[Optimizer]
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter's and optimizer state tensor's local shard, named for a person, in the
    same order on every replica."""
    out = []
    for part, opt in zip(parts, optimizers, strict=True):
        named = list(part.named_parameters())
        out += [(n, _local(p.detach())) for n, p in named]
        by_param = {id(p): n for n, p in named}
        for p in (q for g in opt.param_groups for q in g["params"]):
            for k, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out.append((f"{by_param[id(p)]} ({k})", _local(v)))
    return out


@torch.no_grad()
def fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """int64 per tensor: the wrapping sum of its bytes read as 64-bit words (one flipped bit
    moves it by a power of two, modulo 2^64: never zero). Eight-byte words where the tensor's
    size allows, because a narrower word summed into int64 is first cast to a widened copy
    of the whole tensor (measured 18x slower on CPU, and on a GPU a third of a short step);
    its own width otherwise."""
    return (
        torch.stack([_word_sum(t) for _, t in tensors])
        if tensors
        else torch.zeros(0, dtype=torch.int64)
    )


@torch.no_grad()
def sums(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """float64 per tensor: the sum of its values. Unlike the fingerprint it moves by as much as
    the values do, so two states' sums tell how far apart they lie, not only whether."""
    return torch.stack([t.sum(dtype=torch.float64) for _, t in tensors])


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    flat, size = t.reshape(-1), t.element_size()
    if flat.numel() * size % 8 == 0 and flat.storage_offset() * size % 8 == 0:
        return flat.view(torch.int64).sum()
    return flat.view(_WORD[size]).sum(dtype=torch.int64)


@dataclass(frozen=True)
class Disagreement:
    """What one DP group found: the first tensor whose sums differ, the group's ranks that
    disagree, and those outside a strict majority (empty when there is none)."""

    tensor: str
    ranks: list[int]
    outvoted: list[int]


def disagreement(
    rows: torch.Tensor, group_ranks: list[int], names: list[str]
) -> Disagreement | None:
    """`rows`: one fingerprint row per replica, in `group_ranks` order."""
    differs = (rows != rows[0]).any(dim=0)
    if not bool(differs.any()):
        return None
    col = int(differs.nonzero()[0])
    values = rows[:, col].tolist()
    top = max(set(values), key=values.count)
    if values.count(top) * 2 <= len(values):  # two replicas, or a tie: nobody is outvoted
        return Disagreement(names[col], list(group_ranks), [])
    outvoted = [r for r, v in zip(group_ranks, values, strict=True) if v != top]
    return Disagreement(names[col], list(group_ranks), outvoted)


class ReplicaCheck:
    """One rank's side of the fingerprint comparison. Every rank of the world calls `check` at
    the same steps (it ends in a world all-reduce, so PP stages and TP peers stop together)."""

    def __init__(self, spec: JobSpec, ctx: RankContext):
        self.every, self.ctx = spec.sdc.every_steps, ctx
        # under expert parallelism only the replicas of one expert shard hold the same state
        self.group = ctx.mesh["edp" if spec.parallel.ep > 1 else "dp"].get_group()
        self.group_ranks = dist.get_process_group_ranks(self.group)

    @staticmethod
    def applies(spec: JobSpec) -> bool:
        """Checks are on and replicas exist (services/spec.py `has_replicas`)."""
        return spec.sdc.enabled and has_replicas(spec.parallel)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def compare(self, tensors: list[tuple[str, torch.Tensor]], fp: torch.Tensor) -> list:
        """Every rank's Disagreement (or None), gathered over the world; [] when all agree."""
        rows = [torch.empty_like(fp) for _ in self.group_ranks]
        dist.all_gather(rows, fp, group=self.group)
        found = disagreement(torch.stack(rows), self.group_ranks, [n for n, _ in tensors])
        flag = torch.tensor([int(found is not None)], device=fp.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return []
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        return [d for d in every if d is not None]


def blame(reports: list[dict], disagreeing: list[int]) -> list[int]:
    """The disagreeing ranks the replay blames. `reports`: every rank's {rank,
    diverged_at (the first step at which its parameters differed from the replay, or None),
    changed (its whole state after the replay differs from before)}.

    Every disagreeing rank leaving its history at the same first step is no corruption's
    trace (that reaches the other replicas a step after its own): it is a replay that does not
    reproduce the run, as on a GPU whose backward kernels accumulate with atomics. It blames
    nobody, rather than every replica."""
    diverged = {r["rank"]: r["diverged_at"] for r in reports if r["diverged_at"] is not None}
    if diverged:
        first = min(diverged.values())
        at_first = sorted(r for r in disagreeing if diverged.get(r) == first)
        return [] if len(disagreeing) > 1 and at_first == sorted(disagreeing) else at_first
    changed = {r["rank"] for r in reports if r["changed"]}
    return sorted(r for r in disagreeing if r in changed)


# How many times the smallest replica's distance from the replay a rank's must be, at the step
# the replicas' distances part, to be blamed: a corruption moves a state by far more than the
# re-execution noise of a few units in the last place (a flipped high mantissa bit, by a
# quarter of the value at least); a flip too small to pass it is too small to name anyone.
DECISIVE = 8.0


def drifted(reports: list[dict], groups: list[tuple[int, ...]]) -> tuple[list[int], str]:
    """The ranks blamed by their distance from the replay, and a sentence on it ([], "" when
    none is). `reports`: every rank's `drift`, its parameters' distance from its replay after
    each replayed step (NaN where the step's sums were not kept); `groups`: the disagreeing
    replica groups. In each group, at the first step whose distances are not all equal, the
    ranks whose distance is more than DECISIVE times the smallest."""
    drift = {r["rank"]: r["drift"] for r in reports}
    blamed, said = [], []
    for group in groups:
        for offset, column in enumerate(zip(*(drift[r] for r in group), strict=True)):
            if any(math.isnan(d) for d in column):
                break
            if len(set(column)) > 1:
                low = min(column)
                far = [r for r, d in zip(group, column, strict=True) if d > DECISIVE * low]
                blamed += far
                if far:
                    said.append(
                        f"{offset + 1} step(s) into the replay rank(s) {far} lay "
                        f"{max(column):.3g} from it, their replicas {low:.3g}"
                    )
                break
    return sorted(set(blamed)), "; ".join(said)
