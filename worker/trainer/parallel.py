"""The parallel layout of one trainer: degrees, the DeviceMesh, and the apply_* helpers.

Concessions, each on purpose:
- TP splits attention by heads (q/k/v column-wise, o row-wise) and the MLP (gate/up
  column-wise, down row-wise), as torchtitan does. `loss_parallel` (default) shards the
  embedding (row-wise) and the LM head (column-wise) over the vocabulary and computes the
  cross-entropy on the logits' vocab shards; `sequence_parallel` (default) runs the norms
  on sequence shards. Turned off, those stay replicated across TP (every TP rank computes
  them whole): the simpler layout, kept for comparison and debugging.
- The model is laid out on the meta device and only then materialized (step.py), so TP
  and FSDP here only place parameters, never move data.
- `zero` levels map onto FSDP2 exactly:
    0  replicate: full parameters, gradients and optimizer state on every DP rank;
       gradients all-reduced. DDP's own reducer (composable `replicate`) when the whole
       world is data parallel in fp32, FSDP2's `replicate` otherwise (`apply_fsdp`).
    2  shard gradients + optimizer state: `fully_shard(reshard_after_forward=False)`;
       parameters stay gathered between forward and backward (ZeRO-2). Under a pipeline,
       gradients are reduced once per step, after the last microbatch (torch's stage).
    3  full shard: parameters re-sharded after forward, gathered again for backward; under
       a pipeline also after every microbatch's backward, with its gradients reduced then
       (pipeline.py: `ShardedStage`), so the rank never holds its stage unsharded.
- `precision: bf16` is FSDP2's MixedPrecisionPolicy, never autocast: one mechanism for
  every layout, so at dp 1 the model is wrapped too (on a one-rank DP mesh, where it only
  casts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from services.mesh import AXES, Coord, MeshShape
from services.spec import ParallelSpec
from worker.trainer.gloo_comms import use_in_place_comms
from worker.trainer.moe import ExpertGroups, MoE
from worker.trainer.vocab_embedding import VocabParallelEmbedding


@dataclass(frozen=True)
class ParallelDims:
    spec: ParallelSpec
    device_type: str

    @property
    def shape(self) -> MeshShape:
        return MeshShape(self.spec.dp, self.spec.pp, self.spec.tp, self.spec.ep)

    def build_mesh(self) -> DeviceMesh:
        """(dp, pp, tp); with ep > 1, dp is laid out as (edp, ep) and flattened back to "dp",
        so rank numbering is unchanged (services/mesh.py): "ep" holds one expert shard per
        rank and "edp" the replicas of one expert shard."""
        s = self.spec
        if s.ep == 1:
            return init_device_mesh(self.device_type, (s.dp, s.pp, s.tp), mesh_dim_names=AXES)
        mesh = init_device_mesh(
            self.device_type,
            (s.dp // s.ep, s.ep, s.pp, s.tp),
            mesh_dim_names=("edp", "ep", "pp", "tp"),
        )
        mesh["edp", "ep"]._flatten("dp")
        return mesh


def mesh_groups(mesh: DeviceMesh) -> dict[str, dist.ProcessGroup]:
    """The process group of each of the mesh's dimensions by name, the flattened "dp" of an
    expert-parallel mesh included."""
    names = list(mesh.mesh_dim_names or ())
    groups = {name: mesh.get_group(name) for name in names}
    if "edp" in names:
        groups["dp"] = mesh["dp"].get_group()
    return groups


@dataclass(frozen=True)
class RankContext:
    """Everything a rank needs to know about where it sits; passed explicitly."""

    dims: ParallelDims
    mesh: DeviceMesh
    rank: int
    device: torch.device

    @property
    def coord(self) -> Coord:
        return self.dims.shape.coord(self.rank)

    @property
    def is_last_stage_leader(self) -> bool:
        """One rank per DP replica that owns the loss value (last stage, tp 0)."""
        c = self.coord
        return c.pp == self.dims.spec.pp - 1 and c.tp == 0


def _block_plan(sequence_parallel: bool, qk_norm: bool = False) -> dict:
    """Heads (query and key/value alike) and MLP widths split over TP; with sequence
    parallelism the norms run on sequence shards, so attention and MLP gather their input
    first and reduce-scatter out. Per-head q/k norms (Qwen3) see this rank's heads only: their
    gains are replicated DTensors over a head-sharded input (dim 2 of (B, T, H, D)), so each
    gain's gradient is summed over the TP ranks' heads, as torchtitan's Qwen3 plan does."""
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
    }
    if qk_norm:
        for norm in ("attn.q_norm", "attn.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        return plan | {"attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()}
    return plan | {
        "attn_norm": SequenceParallel(),
        "mlp_norm": SequenceParallel(),
        # Attention(x, cos, sin): only x is an activation; the RoPE tables pass as they are
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def _ends_plan(model: nn.Module, p: ParallelSpec) -> dict:
    """Embedding, final norm and head, for the ones this pipeline stage holds. Between them
    the residual stream is Shard(1) (sequence) with sequence parallelism, else replicated.
    The head's logits stay local vocab shards under loss_parallel (see `vocab_sharded`)."""
    stream = Shard(1) if p.sequence_parallel else Replicate()
    plan: dict = {}
    # a vocab-parallel embedding is a module of its own (`apply_tp`), not a plan entry
    if model.embed is not None and p.sequence_parallel and not p.loss_parallel:
        plan["embed"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=stream
        )
    if model.norm is not None and p.sequence_parallel:  # the last stage's, before the head
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        if p.loss_parallel:
            plan["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1))
        elif p.sequence_parallel:
            plan["head"] = PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    return plan


def vocab_sharded(p: ParallelSpec) -> bool:
    """Whether the head's output is this rank's vocab shard of the logits (loss_parallel)."""
    return p.tp > 1 and p.loss_parallel


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, p: ParallelSpec) -> None:
    """torchtitan's plan (docs/architecture.md, "Trainer"): vocab-parallel embedding and head
    with `loss_parallel`, sequence-parallel norms with `sequence_parallel`. A mixture of
    experts takes its input in whatever layout the norm leaves and splits its experts itself
    (`apply_experts`)."""
    qk_norm = any(block.attn.q_norm is not None for block in model.layers.values())
    block_plan = _block_plan(p.sequence_parallel, qk_norm)
    stream = Shard(1) if p.sequence_parallel else Replicate()
    moe_plan = {k: v for k, v in block_plan.items() if not k.startswith("mlp.")} | {
        # the layer's input as a DTensor, so it knows the layout to gather from and return to
        "mlp": PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(stream,), use_local_output=False
        )
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, moe_plan if isinstance(block.mlp, MoE) else block_plan)
    ends = _ends_plan(model, p)
    if ends:
        parallelize_module(model, tp_mesh, ends)
    if model.embed is not None and p.loss_parallel:
        model.embed = VocabParallelEmbedding.shard(model.embed, tp_mesh, stream)


def apply_experts(model: nn.Module, mesh: DeviceMesh, p: ParallelSpec) -> None:
    """Each MoE layer's experts split over "ep" (dim 0: experts/ep whole experts per rank) and
    over "tp" (each expert's hidden width, as the dense MLP's gate/up column-wise and down
    row-wise), and the groups the layer exchanges tokens and partial sums in."""
    dims = [d for d, n in (("ep", p.ep), ("tp", p.tp)) if n > 1]
    if not dims:
        return
    sub = mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
    groups = ExpertGroups(
        ep=mesh["ep"].get_group() if p.ep > 1 else None,
        tp=mesh["tp"].get_group() if p.tp > 1 else None,
    )
    hidden = {"w_gate": 2, "w_up": 2, "w_down": 1}
    for block in model.layers.values():
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        moe.groups = groups
        experts = moe.experts
        for name, dim in hidden.items():
            placements = [Shard(0) if d == "ep" else Shard(dim) for d in dims]
            w = getattr(experts, name)
            experts.register_parameter(name, nn.Parameter(distribute_tensor(w, sub, placements)))
        # an expert's gradient sums every EP rank's tokens; the DP reduction divides by the
        # replicas of its shard (edp) only, so 1/ep here makes it the mean over all of dp
        experts.grad_scale = 1.0 / p.ep


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero: int,
    precision: str,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """Shard each block, the embedding and the head, then the remainder (the final norm) as
    the root group. With expert parallelism (`experts_mesh`: "edp", the replicas of one expert
    shard), each layer's experts form a group of their own over those replicas first, so the
    block's group over all of dp leaves them out (their shards differ across "ep").

    bf16: parameters are cast to bf16 for forward and backward while the sharded fp32
    parameters stay the optimizer's master weights, and gradients are reduced in fp32."""
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32 if precision == "bf16" else None,
    )
    if experts_mesh is not None:
        for block in model.layers.values():
            if isinstance(block.mlp, MoE):
                _data_parallel(block.mlp.experts, experts_mesh, zero, mp)
    whole_world = dp_mesh.size() == dist.get_world_size() and experts_mesh is None
    if zero == 0 and precision == "fp32" and whole_world:
        # The whole world is data parallel: DDP's own reducer (composable `replicate`, as
        # torchtitan does for 1D meshes), which overlaps its bucketed all-reduces with
        # backward and copies no parameters. FSDP2's replicate copies every parameter in
        # and every gradient out each step, and on CPU blocks backward in each group's
        # all-reduce: 0.85-0.9 of DDP at dp2 (bench/throughput.py). It wraps lazily, at
        # the first forward, so the meta-device model is materialized by then.
        from torch.distributed._composable.replicate import replicate as ddp

        ddp(model, device_mesh=dp_mesh)
        return
    for block in model.layers.values():
        _data_parallel(block, dp_mesh, zero, mp)
    # The embedding and the head are groups of their own, as in torchtitan: at a real vocab
    # each is the largest unit of the model, so it is gathered only around its own forward
    # and backward, never for the whole stage as the root's parameters would be.
    # They are not resharded after forward: the head's backward follows its forward at once,
    # and a second all-gather of the embedding would cost more transient memory (its output
    # and copy-out, twice the unsharded size) than holding it costs.
    for edge in (model.embed, model.head):
        if edge is not None:
            _data_parallel(edge, dp_mesh, min(zero, 2), mp)
    _data_parallel(model, dp_mesh, zero, mp)


def _data_parallel(
    module: nn.Module, mesh: DeviceMesh, zero: int, mp: MixedPrecisionPolicy
) -> None:
    """One FSDP2 group: replicated at zero 0, else sharded (and resharded after forward at 3)."""
    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=mesh, mp_policy=mp)
    else:
        fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp)
        if mesh.device_type == "cpu":  # gloo: without its full-size copies (gloo_comms.py)
            use_in_place_comms(module)
