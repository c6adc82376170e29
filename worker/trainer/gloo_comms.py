"""FSDP2's all-gather and reduce-scatter on gloo without full-size copies (issue 12).

torch's ProcessGroupGloo has no reduce-scatter of its own: `reduce_scatter_tensor` clones the
whole input, all-reduces the clone and copies one chunk out. Its `all_gather_into_tensor`
gathers into a flat buffer of its own and copies that into the output. FSDP2 hands both
calls a buffer that is already the unsharded size, so each adds one more unsharded-size
copy. At a real vocabulary the embedding's and the head's groups are 0.5 GB per TP shard,
and with eight ranks on one host those copies were what kept the 1b preset out of 24 GiB.

The same collectives without the copies, for FSDP2's `set_custom_all_gather` and
`set_custom_reduce_scatter`:
- all-gather: FSDP2 copies each rank's shard into its own chunk of the output (the input is a
  view of that chunk), so one broadcast per rank, in place, fills the rest;
- reduce-scatter: the input is FSDP2's own copy of the unsharded gradients, used once, so it
  is all-reduced in place and this rank's chunk copied out.
Both compute what gloo's own calls compute, the same additions in the same order, so results
are bitwise those of the default path (tests/numerics/test_gloo_comms.py). NCCL has real
collectives and keeps FSDP2's defaults.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _AllOf(dist.Work):
    """Several works as one: done when all are (FSDP2 waits on one work per all-gather)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        return True


def _empty(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


class InPlaceAllGather(AllGather):
    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        chunks = output_tensor.chunk(group.size())
        if input_tensor.data_ptr() != chunks[group.rank()].data_ptr():
            raise RuntimeError(
                "FSDP2 no longer copies the shard into its own chunk of the all-gather "
                "output; InPlaceAllGather relies on it (check the pinned torch version)"
            )
        works = [
            dist.broadcast(chunk, group=group, group_src=src, async_op=True)
            for src, chunk in enumerate(chunks)
        ]
        done = _AllOf(works)
        if async_op:
            return done
        done.wait()
        return None


class InPlaceReduceScatter(ReduceScatter):
    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
        return None


def use_in_place_comms(module: FSDPModule) -> None:
    """Give one FSDP2 group on gloo the copy-free collectives above."""
    module.set_custom_all_gather(InPlaceAllGather())
    module.set_custom_reduce_scatter(InPlaceReduceScatter())
