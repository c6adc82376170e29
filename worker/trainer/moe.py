"""Mixture of experts: a top-k router and SwiGLU experts, dispatched over the expert-parallel
axis by all-to-all (docs/architecture.md, "Experts").

Routing, per token: softmax over the router's logits gives the probabilities the balance loss
uses; the top_k logits, softmaxed among themselves, weight the chosen experts' outputs
(Mixtral's rule). Everything that couples tokens is computed per sequence, so a layout that
splits the batch differently (DP, microbatches) routes, drops and balances exactly as one
process does:
- dropless (`model.capacity_factor: 0`, the default): every choice is computed;
- with a capacity factor c, expert e takes at most ceil(c * seq_len * top_k / experts) of one
  sequence's choices, first choices before second choices, earlier tokens first; a dropped
  choice adds nothing (the token keeps its residual and its other choices);
- the balance loss is Switch's, per sequence: experts * sum_e f_e * P_e, where f_e is the
  share of the sequence's choices routed to e and P_e its mean router probability; its mean
  over sequences, times `model.aux_loss_coef`, joins the training objective through the layer's
  output (`_with_aux`), so pipeline stages need no extra loss plumbing.

Expert weights are stacked, (experts, d_model, hidden) for gate and up and (experts, hidden,
d_model) for down; under EP each rank holds experts/ep of them (worker/trainer/parallel.py,
`apply_experts`) and under TP each expert's hidden width is split like the dense MLP's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from services.spec import ModelSpec
from worker.trainer import grouped_gemm
from worker.trainer.comm_autograd import (
    all_to_all,
    copy_to,
    exchange_counts,
    reduce_from,
    scale_grad,
)


@dataclass(frozen=True)
class ExpertGroups:
    """Who shares the experts' work: `ep` splits the experts, `tp` splits each expert's hidden
    width. None: that axis has degree 1."""

    ep: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.ep) if self.ep is not None else 1


@dataclass
class Routing:
    weights: torch.Tensor  # (B, T, k): the chosen experts' weights, zero where dropped
    chosen: torch.Tensor  # (B, T, k): expert ids
    kept: torch.Tensor  # (B, T, k): bool, False where capacity dropped the choice
    balance: torch.Tensor  # 0-dim: the mean per-sequence balance loss


class Router(nn.Module):
    def __init__(self, d_model: int, experts: int, top_k: int, capacity_factor: float):
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x).float()  # (B, T, E); fp32 whatever the compute dtype
        top, chosen = logits.topk(self.top_k, dim=-1)
        kept = self._within_capacity(chosen)
        weights = top.softmax(-1) * kept
        # Switch's balance loss, per sequence: E * sum_e f_e P_e
        t = x.shape[1]
        share = _one_hot(chosen, self.experts).sum((1, 2)).float() / (t * self.top_k)
        prob = logits.softmax(-1).mean(1)
        balance = (self.experts * (share * prob).sum(-1)).mean()
        return Routing(weights, chosen, kept, balance)

    def _within_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        if not self.capacity_factor:
            return torch.ones_like(chosen, dtype=torch.bool)
        b, t, k = chosen.shape
        cap = math.ceil(self.capacity_factor * t * k / self.experts)
        # choice-major order within each sequence: every token's first choice, then seconds
        order = chosen.transpose(1, 2).reshape(b, k * t)
        onehot = _one_hot(order, self.experts)
        place = (onehot.cumsum(1) * onehot).sum(-1)  # 1-based place in its expert's queue
        return (place <= cap).view(b, k, t).transpose(1, 2)


def _one_hot(ids: torch.Tensor, n: int) -> torch.Tensor:
    """F.one_hot without its range check: router ids are in range by construction, and the
    check reads their minimum and maximum on the host on every device but CUDA, so without it
    the layer reads nothing on the host anywhere and a CPU test can hold it to that."""
    return (ids.unsqueeze(-1) == torch.arange(n, device=ids.device)).long()


class Experts(nn.Module):
    """`experts` SwiGLU FFNs as stacked weights; forward takes rows grouped by expert and
    computes them with one grouped GEMM per weight (worker/trainer/grouped_gemm.py), or expert
    by expert where torch's grouped GEMM refuses the shapes."""

    def __init__(self, experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w_up = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.grad_scale = 1.0  # set by apply_experts: see MoE._experts_on_holders

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`counts`: rows per expert, on x's device."""
        gate, up, down = (self._local(w) for w in (self.w_gate, self.w_up, self.w_down))
        if grouped_gemm.takes(x, gate, up, down):
            ends = counts.cumsum(0, dtype=torch.int32)
            return grouped_gemm.swiglu_experts(x, gate, up, down, ends)
        out = [
            (F.silu(rows @ gate[e]) * (rows @ up[e])) @ down[e]
            for e, rows in enumerate(x.split(counts.tolist()))
        ]
        return torch.cat(out)

    def _local(self, w: torch.Tensor) -> torch.Tensor:
        w = w.to_local() if isinstance(w, DTensor) else w
        return scale_grad(w, self.grad_scale) if self.grad_scale != 1.0 else w


class MoE(nn.Module):
    """Router, experts and the exchanges between them; stands where a dense block has its MLP."""

    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.router = Router(cfg.d_model, cfg.experts, cfg.top_k, cfg.capacity_factor)
        self.experts = Experts(cfg.experts, cfg.d_model, cfg.ffn)
        self.num_experts, self.top_k = cfg.experts, cfg.top_k
        self.groups = ExpertGroups()
        # the balance loss's weight in the objective: aux_loss_coef, divided by the
        # microbatch count as the cross-entropy is (worker/trainer/step.py sets it)
        self.aux_weight = cfg.aux_loss_coef
        self.stats = LoadStats(cfg.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, for_experts, layout = self._gather(x)
        b, t, d = tokens.shape
        routing = self.router(tokens)
        y, counts = self._dispatch(for_experts.reshape(b * t, d), routing)
        if _training_forward():
            self.stats.add(counts, routing)
        return _with_aux(self._scatter(y.view(b, t, d), layout), routing.balance, self.aux_weight)

    def _gather(self, x: torch.Tensor):
        """(tokens for the router, tokens for the experts, the input's TP layout). Under TP
        every rank routes all of the sequence (the norm before it may hold only a sequence
        shard) and computes with its slice of every expert, so the experts' share of the
        input's gradient is a partial sum over TP (`copy_to`); the router's is not."""
        if not isinstance(x, DTensor):  # no TP (apply_tp hands the layer a DTensor)
            return x, x, None
        layout = (x.device_mesh, x.placements)  # sequence shards under sequence parallelism
        x = x.redistribute(x.device_mesh, [Replicate()]).to_local()
        return x, copy_to(x, self.groups.tp), layout

    @staticmethod
    def _scatter(y: torch.Tensor, layout) -> torch.Tensor:
        if layout is None:
            return y
        mesh, placements = layout
        whole = DTensor.from_local(y, mesh, [Replicate()], run_check=False)
        return whole.redistribute(mesh, placements).to_local()

    def _dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Each kept (token, choice) row to its expert and back, weighted and summed per token;
        and the kept rows per expert. The combine is a gather and a sum over the k choices,
        never a scatter-add, so the result is deterministic on every device.

        Dropless routing keeps every choice, so nothing here waits for the device: the rows
        are sorted by expert and each expert's end is found in the sorted ids (bincount would
        read the largest id on the host first). A capacity factor makes the number of kept
        rows data, read once (`nonzero`)."""
        k = self.top_k
        chosen = routing.chosen.reshape(-1)
        if self.router.capacity_factor:
            rows = routing.kept.reshape(-1).nonzero().squeeze(1)
            experts, order = chosen[rows].sort(stable=True)
            rows = rows[order]  # grouped by expert, in row order
        else:
            experts, rows = chosen.sort(stable=True)
        ids = torch.arange(self.num_experts, device=x.device)
        ends = torch.searchsorted(experts, ids, right=True)
        counts = ends.diff(prepend=ends.new_zeros(1))
        out = self._experts_on_holders(x[rows // k], counts)
        per_choice = x.new_zeros((x.shape[0] * k, x.shape[1]))
        per_choice = per_choice.index_put((rows,), out)
        weights = routing.weights.reshape(-1, k, 1).to(x.dtype)
        return (per_choice.view(-1, k, x.shape[1]) * weights).sum(1), counts

    def _experts_on_holders(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by global expert id -> their outputs, same order. Under EP, experts
        [i*E/ep, (i+1)*E/ep) live on EP rank i: rows travel there and back by all-to-all. An
        expert's weight gradient is then the sum over every EP rank's tokens, which the data
        parallel reduction (over the replicas of that expert shard only) does not divide by
        ep: `Experts.grad_scale` = 1/ep does."""
        groups, ep = self.groups, self.groups.ep_size
        if ep == 1:
            return self._compute(rows, counts)
        local = self.num_experts // ep
        received = exchange_counts(counts, groups.ep).view(ep, local)  # [source, my expert]
        # the layer's one host sync: an all-to-all takes its split sizes on the host
        send, receive = torch.stack((counts.view(ep, local).sum(1), received.sum(1))).tolist()
        arrived = all_to_all(rows, send, receive, groups.ep)  # by source, then by expert
        expert_of = torch.arange(local, device=rows.device).repeat(ep)
        by_expert = expert_of.repeat_interleave(
            received.flatten(), output_size=sum(receive)
        ).argsort(stable=True)
        out = self._compute(arrived[by_expert], received.sum(0))
        back = torch.empty_like(out).index_put((by_expert,), out)
        return all_to_all(back, receive, send, groups.ep)

    def _compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = self.experts(rows, counts)
        # under TP each rank holds a slice of every expert's hidden width: partial sums
        return reduce_from(out, self.groups.tp) if self.groups.tp is not None else out


class LoadStats:
    """Routing counts of a step's forwards, for the router load metrics: kept choices per
    expert, dropped choices, and the summed balance loss (detached; once per training forward,
    see `_training_forward`).

    A step runs each layer once per microbatch, so `take` keeps the last `per_step` forwards:
    a pipeline stage built without its metadata runs once more before them, on placeholder
    values, to infer the shapes it sends (torch.distributed.pipelining's metadata inference;
    the trainer's stages are given theirs, worker/trainer/pipeline.py `stage_io`, but a torch
    that ignored it would infer); that routing is no batch's."""

    def __init__(self, experts: int, per_step: int = 1):
        self.experts, self.per_step = experts, per_step
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, kept: torch.Tensor, r: Routing) -> None:
        """`kept`: the forward's kept choices per expert (MoE._dispatch's counts)."""
        with torch.no_grad():
            dropped = (~r.kept).sum()
            self._parts.append((kept.detach(), dropped, r.balance.detach()))

    def take(self) -> torch.Tensor | None:
        """(experts + 2,) float64: kept per expert, dropped, balance-loss sum; None if no
        forward ran (a pipeline stage without this layer's turn)."""
        if not self._parts:
            return None
        parts, self._parts = self._parts[-self.per_step :], []
        kept = torch.stack([p[0] for p in parts]).sum(0).double()
        dropped = torch.stack([p[1] for p in parts]).sum().double()
        balance = torch.stack([p[2] for p in parts]).sum().double()
        return torch.cat((kept, dropped[None], balance[None]))


def _training_forward() -> bool:
    """A forward whose routing the step's metrics count: not one without gradients (the
    pipeline stage's shape inference), not one run inside the backward pass (activation
    checkpointing's recompute)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class _AttachAux(torch.autograd.Function):
    """Forward returns y; backward also feeds `weight` as the aux loss's gradient, so the loss
    joins the objective from inside the layer (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_shape, ctx.aux_dtype = weight, aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (
            grad,
            torch.full(ctx.aux_shape, ctx.weight, dtype=ctx.aux_dtype, device=grad.device),
            None,
        )


def _with_aux(y: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
    return _AttachAux.apply(y, aux, weight) if weight else y
