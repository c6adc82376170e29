"""Pipeline stages and schedules on torch.distributed.pipelining.

Stage i of S = pp * virtual_stages holds layers [i*L/S, (i+1)*L/S); stage 0 the
embedding, stage S-1 the final norm and head. Pipeline rank r holds stages
r, r+pp, r+2pp, ... (the looped layout interleaved 1F1B expects).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from services.spec import ParallelSpec
from worker.trainer.model import Transformer

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


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
    stages = [PipelineStage(m, i, n, device, group=group) for i, m in parts]
    # Loss is pre-divided by the microbatch count, so the schedule must not rescale.
    if p.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, p.microbatches, loss_fn=loss_fn, scale_grads=False)
    return SCHEDULES[p.pp_schedule](stages[0], p.microbatches, loss_fn=loss_fn, scale_grads=False)
