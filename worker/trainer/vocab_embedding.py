"""The vocab-parallel embedding (`loss_parallel`): each TP rank holds a slice of the
vocabulary's rows and computes the gradient of that slice only.

torch's `RowwiseParallel` on an `nn.Embedding` computes the same forward (a masked lookup in
the local rows, then a sum over TP), but DTensor has no vocab-sharded rule for the
embedding's backward: its gradient comes back `Replicate`, the whole vocabulary on every TP
rank, and is sliced to the shard only afterwards. At a 128k vocabulary and d_model 2048 that
is 1 GB of fp32 gradient per rank where 0.5 GB is its share, plus the slice (issue 12).

Here the lookup runs on the local tensor, so autograd hands back a gradient laid out like
the weight (`Shard(0)`), and the partial sums go to the residual stream's layout through
DTensor (an all-reduce, or a reduce-scatter over the sequence with sequence parallelism).
The additions are the ones `RowwiseParallel` makes, so the numbers are its numbers
(tests/numerics/test_parity.py holds every TP layout to one process).

A tied LM head (`model.tie_embeddings`) is the same weight used as the head: `logits` gives
this rank's vocabulary shard of the logits, the layout `ColwiseParallel` gives an untied head
under loss_parallel, and the weight's gradient gets both uses' contributions in its one shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class VocabParallelEmbedding(nn.Embedding):
    """Built with `shard`, from the model's embedding; the parameter keeps its name."""

    mesh: DeviceMesh
    output_layout: Placement
    first_row: int  # the global id of this rank's first row

    @classmethod
    def shard(
        cls, embedding: nn.Embedding, tp_mesh: DeviceMesh, output_layout: Placement
    ) -> VocabParallelEmbedding:
        vocab, dim = embedding.weight.shape
        out = cls(vocab, dim, device="meta")
        weight = distribute_tensor(embedding.weight, tp_mesh, [Shard(0)])
        out.weight = nn.Parameter(weight, requires_grad=embedding.weight.requires_grad)
        out.mesh, out.output_layout = tp_mesh, output_layout
        _, (out.first_row, _) = compute_local_shape_and_global_offset(
            weight.shape, tp_mesh, weight.placements
        )
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.is_floating_point():  # hidden states: the tied head (model.Embedding)
            return self.logits(tokens)
        rows = self.weight.to_local()  # under FSDP2: the gathered TP shard
        outside = (tokens < self.first_row) | (tokens >= self.first_row + rows.shape[0])
        local_ids = (tokens - self.first_row).masked_fill(outside, 0)
        looked_up = F.embedding(local_ids, rows).masked_fill(outside.unsqueeze(-1), 0.0)
        summed = DTensor.from_local(looked_up, self.mesh, [Partial()], run_check=False)
        return summed.redistribute(self.mesh, [self.output_layout]).to_local()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head: this rank's vocabulary shard of the logits (Shard(-1), as the
        loss_parallel loss takes them). `hidden` is the final norm's output in the residual
        stream's layout: a DTensor over the sequence with sequence parallelism, else the
        local (replicated) tensor. Gathered to every rank first; in backward its gradient's
        partial sums over TP go back to that layout (an all-reduce or a reduce-scatter)."""
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, self.mesh, [self.output_layout], run_check=False)
        whole = hidden.redistribute(self.mesh, [Replicate()])
        return F.linear(whole, self.weight).to_local()
