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

from services.spec import ParallelSpec
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


def build_schedule(
    parts: list[tuple[int, torch.nn.Module]],
    p: ParallelSpec,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable,
):
    n = p.pp * p.virtual_stages
    group = pp_mesh.get_group()
    stages = [ShardedStage(m, i, n, device, group=group, zero=p.zero) for i, m in parts]
    # Loss is pre-divided by the microbatch count, so the schedule must not rescale.
    if p.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, p.microbatches, loss_fn=loss_fn, scale_grads=False)
    return SCHEDULES[p.pp_schedule](stages[0], p.microbatches, loss_fn=loss_fn, scale_grads=False)
