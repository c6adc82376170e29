"""One rank's model, optimizer and train step for any (dp, pp, tp) layout.

Every layout builds the full model on the meta device, cuts its pipeline stage, applies TP,
activation checkpointing and FSDP, in that order (the order torchtitan uses: FSDP must wrap
the TP-sharded parameters), and only then materializes its own shards, with values that
depend on (train.seed, parameter name) alone (docs/architecture.md, "Trainer").
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from services.records import ExpertLoad
from services.spec import JobSpec
from worker.hf.weights import load_into
from worker.progress import Collectives
from worker.trainer.activation_checkpoint import apply_ac
from worker.trainer.data import Batches
from worker.trainer.device_probe import device_probe
from worker.trainer.memory import peak_mem_bytes
from worker.trainer.model import build_model
from worker.trainer.moe import MoE
from worker.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from worker.trainer.parallel import (
    RankContext,
    apply_experts,
    apply_fsdp,
    apply_tp,
    vocab_sharded,
)
from worker.trainer.pipeline import build_schedule, split_stages
from worker.trainer.prefetch import Prefetcher
from worker.trainer.tied_copies import TiedCopies
from worker.trainer.timing import step_clock


class NonFiniteError(RuntimeError):
    pass


@dataclass
class StepResult:
    step: int  # steps completed, this one included (services/records.py)
    loss: float
    grad_norm: float
    lr: float
    step_s: float
    compute_s: float
    wait_s: float
    tokens: int
    probe_s: float | None  # the device probe's GEMM (GPU ranks; worker/trainer/device_probe.py)
    peak_mem_bytes: int  # this process's peak so far (worker/trainer/memory.py)
    experts: ExpertLoad | None = None  # the step's routing (MoE models, global rank 0)
    epoch: int | None = None  # the epoch the step's batch starts in (finite sources)


class Trainer:
    def __init__(
        self,
        spec: JobSpec,
        ctx: RankContext,
        collectives: Collectives | None = None,
        weights: bool = True,
    ):
        """`collectives`: where to count collective phases for the agent (worker/progress.py);
        None counts them in memory only. `weights` False leaves the parameters unwritten for
        a restore to fill (`init_weights` if none does): generating weights a restore then
        overwrites costs a recovery time, and minutes at real sizes."""
        self.spec, self.ctx = spec, ctx
        p, mesh = spec.parallel, ctx.mesh
        full = build_model(spec.model, spec.train.seed, "meta")
        if p.pp > 1:
            parts = split_stages(full, ctx.coord.pp, p)
        else:
            parts = [(0, full)]
        experts_mesh = mesh["edp"] if p.ep > 1 else None
        for _, part in parts:
            if p.tp > 1:
                apply_tp(part, mesh["tp"], p)
            apply_experts(part, mesh, p)
            if p.activation_checkpointing:
                apply_ac(part, p.activation_checkpointing)
            # bf16 goes through FSDP2's mixed precision, so FSDP wraps at dp 1 too
            if p.dp > 1 or p.precision == "bf16":
                apply_fsdp(part, mesh["dp"], p.zero, p.precision, experts_mesh)
            part.to_empty(device=ctx.device)
            part.init_buffers()
        self.parts = [m for _, m in parts]
        self.moe = [m for part in self.parts for m in part.modules() if isinstance(m, MoE)]
        for m in self.moe:
            m.aux_weight = spec.model.aux_loss_coef / p.microbatches  # as the loss is
            m.stats.per_step = p.microbatches
        self.params = [q for m in self.parts for q in m.parameters()]
        # a tied head under a pipeline: the last stage's copy of the embedding (pipeline.py)
        self.tied_copies = TiedCopies.of(self.parts, mesh)
        # One optimizer per pipeline part: checkpoints key optimizer state by each part's
        # parameter names, which is what lets a different pipeline split reload it.
        self.optimizers = [build_optimizer(list(m.parameters()), spec.train) for m in self.parts]
        self.schedulers = [build_scheduler(o, spec.train) for o in self.optimizers]
        self.schedule = (
            build_schedule(parts, spec, mesh["pp"], ctx.device, self._loss_fn) if p.pp > 1 else None
        )
        self.batches = Batches(spec.data, spec.model, spec.train.global_batch, p.dp)
        on_gpu = ctx.device.type == "cuda"
        self.prefetch = Prefetcher(self.batches, ctx.coord.dp) if on_gpu else None
        self.clock = step_clock(ctx.device)
        self.probe = device_probe(ctx.device)
        if on_gpu:  # the process's setting: only this trainer runs in it
            torch.backends.cuda.matmul.allow_tf32 = p.matmul_precision == "tf32"
        self.collectives = collectives or Collectives(None)
        self.vocab_sharded = vocab_sharded(p)
        # chaos.nondeterministic's BackwardNoise (worker/trainer/chaos.py), applied to logits
        self.backward_noise: Callable[[torch.Tensor], torch.Tensor] | None = None
        if weights:
            self.init_weights()

    def init_weights(self) -> None:
        """The initial parameters: `model.hf`'s weights (worker/hf/weights.py), or the
        seed's (worker/trainer/model.py, `init_weights`)."""
        m = self.spec.model
        if m.hf and m.hf_weights:
            load_into(self.parts, m, m.hf)
            return
        for part in self.parts:
            part.init_weights(self.spec.train.seed)

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Mean over the microbatch, pre-divided by the microbatch count: summing the
        # microbatches' gradients then gives the gradient of the local mean loss.
        if self.backward_noise:
            logits = self.backward_noise(logits)
        if self.vocab_sharded:
            # the head's output is this rank's vocab shard (parallel.py); loss_parallel()
            # (entered around forward and backward) computes the cross-entropy on the shards
            logits = DTensor.from_local(logits, self.ctx.mesh["tp"], [Shard(-1)], run_check=False)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        if isinstance(ce, DTensor):
            ce = ce.to_local()  # replicated: every TP rank holds the whole value
        return ce / self.spec.parallel.microbatches

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What a microbatch's forward and backward run inside: loss_parallel() when the
        head's logits are vocab shards."""
        return loss_parallel() if self.vocab_sharded else contextlib.nullcontext()

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One microbatch's loss as training computes it (inside `loss_context`); for
        re-executing a microbatch (worker/trainer/spot_check.py)."""
        return self._loss_fn(logits, target)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Local mean loss (meaningful on last-stage ranks only under PP)."""
        with self.loss_context():
            # asynchronous from a prefetched (page-locked) batch; a copy on CPU ranks
            device = self.ctx.device
            return self._forward_backward_on(
                x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            )

    def _forward_backward_on(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            stage0 = self.ctx.coord.pp == 0
            last = self.ctx.coord.pp == self.spec.parallel.pp - 1
            self.schedule.step(
                *([x] if stage0 else []),
                target=y if last else None,
                losses=losses,
                return_outputs=False,
            )
            return (
                torch.stack(losses).sum().detach() if losses else torch.zeros((), device=x.device)
            )
        total = torch.zeros((), device=x.device)
        model = self.parts[0]
        n = self.spec.parallel.microbatches
        for xm, ym in zip(x.chunk(n), y.chunk(n), strict=True):
            loss = self._loss_fn(model(xm), ym)
            loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def _forward_on(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`_forward_backward_on` without the backward: the same microbatches, the same loss
        function, so a held-out batch's loss is reduced exactly as a training batch's."""
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            stage0 = self.ctx.coord.pp == 0
            last = self.ctx.coord.pp == self.spec.parallel.pp - 1
            self.schedule.eval(*([x] if stage0 else []), target=y if last else None, losses=losses)
            return torch.stack(losses).sum() if losses else torch.zeros((), device=x.device)
        n = self.spec.parallel.microbatches
        model = self.parts[0]
        chunks = zip(x.chunk(n), y.chunk(n), strict=True)
        return sum(
            (self._loss_fn(model(xm), ym) for xm, ym in chunks), torch.zeros((), device=x.device)
        )

    def evaluate(self, batches: int, done=lambda batch: None) -> tuple[float, float]:
        """(mean loss over `batches` held-out global batches, seconds). Parameters, optimizer
        state and MoE routing counts are left as they were. `done(k)` after batch k (1-based):
        a long validation must read as progress, not as a hang."""
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for k in range(batches):
            x, y = self.batches.held_out(k, self.ctx.coord.dp)
            with self.collectives.phase(), self.loss_context():
                local = self._forward_on(x.to(self.ctx.device), y.to(self.ctx.device))
                total += self.global_loss(local, routing=False)[0]
            done(k + 1)
        for m in self.moe:
            m.stats.take()  # held-out tokens are no training step's routing
        # FSDP2 keeps a forward's unsharded parameters registered until the next backward (the
        # root's, and every module's at zero 2): a forward with no backward must reshard, or
        # the module lists other tensors than the optimizer's sharded ones (the state checks
        # read those, worker/trainer/at_rest.py) and holds whole parameters until the next step
        for part in self.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
        return total.item() / batches, time.perf_counter() - t0

    def global_loss(self, local: torch.Tensor, routing: bool = True) -> torch.Tensor:
        """Mean over the global batch as a float64 tensor on the device: each DP replica's
        loss leader adds its share. Reduced where it lies: no host sync (train_step reads it).
        A MoE model's routing counts ride the same all-reduce: (loss, *`_routing`)."""
        share = (
            local.double() / self.spec.parallel.dp
            if self.ctx.is_last_stage_leader
            else torch.zeros((), dtype=torch.float64, device=local.device)
        )[None]
        if self.moe and routing:
            share = torch.cat((share, self._routing()))
        dist.all_reduce(share)
        return share

    def _routing(self) -> torch.Tensor:
        """This rank's MoE layers' counts since the last step (moe.LoadStats), on tp 0 only: the
        other TP ranks routed the same tokens."""
        parts = [t for m in self.moe if (t := m.stats.take()) is not None]
        local = torch.stack(parts).sum(0).to(self.ctx.device)
        return local if self.ctx.coord.tp == 0 else torch.zeros_like(local)

    def _expert_load(self, counts: list[float]) -> ExpertLoad:
        """(kept per expert, dropped, balance-loss sum) over the world -> the step's record."""
        p = self.spec.parallel
        *tokens, dropped, balance = counts
        calls = self.spec.model.layers * p.dp * p.microbatches  # one balance value per layer call
        return ExpertLoad(
            tokens=[round(t) for t in tokens], dropped=round(dropped), balance_loss=balance / calls
        )

    def train_step(self, index: int, before_update=lambda: None) -> StepResult:
        """Run step `index` (0-based: `index` steps are done before it); `before_update` runs
        just before parameters change."""
        # before the step's clock and its first kernel: the GPU is idle since the last step's
        # sync, and the probe is in neither the step's time nor its compute
        probe_s = self.probe.seconds() if self.probe else None
        t0 = time.perf_counter()
        self.clock.start()
        self.collectives.step_boundary()
        if self.prefetch:
            x, y = self.prefetch.local(index)
        else:
            x, y = self.batches.local(index, self.ctx.coord.dp)
        # Each collective phase is counted entered/left (worker/progress.py): the same three
        # phases on every rank, so a hang's counts show which rank the others wait for.
        with self.collectives.phase():
            local = self._forward_backward(x, y)
        p = self.spec.parallel
        with self.collectives.phase(), self.clock.waiting():
            copies = self.tied_copies.params if self.tied_copies else ()
            if self.tied_copies:
                self.tied_copies.sum_gradients()
            norm = clip_grad_norm(self.params, self.spec.train.grad_clip, p.dp * p.tp, copies)
        with self.collectives.phase(), self.clock.waiting():
            global_loss = self.global_loss(local)
        # The step's one host sync: loss and norm come back together (issue 12), and both
        # are checked before any parameter changes.
        loss, grad_norm, *routing = torch.cat(
            (global_loss[:1], norm[None], global_loss[1:])
        ).tolist()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteError(
                f"step {index + 1}: loss {loss}, grad norm {grad_norm} is not "
                "finite; lower train.lr or raise train.warmup_steps"
            )
        lr = self.schedulers[0].get_last_lr()[0]
        before_update()
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - t0
        # Whole-step CPU demand: time blocked in any collective is in neither part of it.
        compute = min(self.clock.stop(), step_s)
        return StepResult(
            index + 1,
            loss,
            grad_norm,
            lr,
            step_s,
            compute,
            step_s - compute,
            self.spec.train.global_batch * self.spec.model.seq_len,
            probe_s,
            peak_mem_bytes(self.ctx.device),
            self._expert_load(routing) if routing and self.ctx.rank == 0 else None,
            self.batches.epoch(index),
        )
