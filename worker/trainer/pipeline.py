"""Pipeline stages and schedules on torch.distributed.pipelining.

Stage i of S = pp * virtual_stages holds layers [i*L/S, (i+1)*L/S); stage 0 the
embedding, stage S-1 the final norm and head (a tied head: a copy of the embedding, kept equal
to stage 0's by worker/trainer/tied_copies.py). Pipeline rank r holds stages
r, r+pp, r+2pp, ... (the looped layout interleaved 1F1B expects).

ZeRO under the pipeline: torch's stage holds an FSDP stage's gradients unreduced, and its
parameters gathered, from the first microbatch's backward to the last (one all-gather and one
reduce-scatter per step). That is zero 2 here: fast, but at real sizes more memory than the
rank's whole sharded state (issue 12: the 1b preset at dp2 x pp2 x tp2). Zero 3 keeps its
sharding across microbatches instead (`ShardedStage`), as ZeRO-3 does with gradient
accumulation and as the planner's memory and cost models assume: each microbatch's gradients
are reduce-scattered into the sharded accumulator as its backward ends, and the parameters
resharded then.

Every stage is built with its input's and output's metadata (`stage_io`), so torch's
`PipelineStage` skips its metadata inference: without it, every stage runs one microbatch's
forward and backward before the first step's schedule, in every generation (a recovery's
too; docs/fault-tolerance.md, "The pipeline's first step").
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from services.spec import JobSpec, ParallelSpec
from worker.trainer.model import Transformer

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class ShardedStage(PipelineStage):
    """A stage whose zero-3 FSDP module reduces every microbatch's gradients and reshards its
    parameters as that microbatch's backward ends (see above). The schedule's final
    REDUCE_GRAD finds nothing left to reduce: FSDP's post-backward is idempotent."""

    def __init__(self, *args, zero: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.zero = zero

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        # Only the schedules meshkeeper runs (GPipe, 1F1B, interleaved 1F1B: "full"
        # backwards) on zero-3 modules (fp32 at dp 1 is not wrapped at all); anything else
        # keeps torch's accumulation.
        sharded = self.zero == 3 and isinstance(self.submod, FSDPModule)
        if backward_type != "full" or not sharded:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)  # the schedule's REDUCE_GRAD closes the step
        self.submod.set_requires_gradient_sync(True)
        self.submod.set_reshard_after_backward(True)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


def stage_ids(pp_rank: int, p: ParallelSpec) -> list[int]:
    return [pp_rank + v * p.pp for v in range(p.virtual_stages)]


def stage_module(full: Transformer, stage: int, num_stages: int) -> Transformer:
    per = full.cfg.layers // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    part = copy.deepcopy(full)
    for key in list(part.layers):
        if key not in keep:
            del part.layers[key]
    if stage != 0:
        part.takes_tokens = False
        # a tied head's last stage keeps a copy of the embedding as its head (tied_copies.py)
        if not (part.tied and stage == num_stages - 1):
            part.embed = None
    if stage != num_stages - 1:
        part.norm = None
        part.head = None
    return part


def split_stages(full: Transformer, pp_rank: int, p: ParallelSpec) -> list[tuple[int, Transformer]]:
    n = p.pp * p.virtual_stages
    return [(i, stage_module(full, i, n)) for i in stage_ids(pp_rank, p)]


def stage_io(spec: JobSpec, stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors shaped as one microbatch's input and output of `stage`, as torch would infer
    them: plain local tensors at every boundary, whatever the layout. The first stage takes the
    token ids; the others take the hidden states, a sequence shard of them under sequence
    parallelism; the last gives the logits, a vocabulary shard of them under loss parallelism;
    activations are in the compute dtype. A float input requires grad: a stage whose input
    does not computes no gradient for the stage before it, whose first update is then wrong
    (step 1's loss equal, step 2's not)."""
    m, p = spec.model, spec.parallel
    batch = spec.train.global_batch // (p.dp * p.microbatches)
    dtype = torch.bfloat16 if p.precision == "bf16" else torch.float32
    seq = m.seq_len // p.tp if p.tp > 1 and p.sequence_parallel else m.seq_len
    vocab = m.vocab // p.tp if p.tp > 1 and p.loss_parallel else m.vocab

    def meta(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    hidden = meta(batch, seq, m.d_model)
    x = meta(batch, m.seq_len, dtype=torch.int64) if stage == 0 else hidden
    y = meta(batch, m.seq_len, vocab) if stage == num_stages - 1 else hidden
    return x, y


def build_schedule(
    parts: list[tuple[int, torch.nn.Module]],
    spec: JobSpec,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable,
):
    p = spec.parallel
    n = p.pp * p.virtual_stages
    group = pp_mesh.get_group()
    stages = []
    for i, m in parts:
        x, y = stage_io(spec, i, n)
        stages.append(
            ShardedStage(m, i, n, device, input_args=x, output_args=y, group=group, zero=p.zero)
        )
    # Loss is pre-divided by the microbatch count, so the schedule must not rescale.
    if p.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, p.microbatches, loss_fn=loss_fn, scale_grads=False)
    return SCHEDULES[p.pp_schedule](stages[0], p.microbatches, loss_fn=loss_fn, scale_grads=False)
