"""Run as 3 ranks (tests/rankrun.py): worker/trainer/gloo_comms.py against gloo's own calls.

For each collective, on the same inputs, prints one JSON line per rank:
- `equal`: the in-place version's result is bitwise gloo's own;
- `grew_default` / `grew_in_place`: how far each call raised the process's peak resident
  memory (VmHWM, reset before each call) beyond its inputs and outputs, all touched before,
  in units of the unsharded buffer's size.
Then one line for FSDP2 itself: a two-layer model's sharded gradients after one backward with
the in-place collectives are bitwise those with the defaults.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from worker.trainer.gloo_comms import InPlaceAllGather, InPlaceReduceScatter, use_in_place_comms

NUMEL = 3 * 2**24  # 192 MiB of fp32: far above what gloo and malloc keep around anyway


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_growth(call) -> float:
    """How far `call()` raised the peak RSS, in units of NUMEL fp32 elements."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    before = _status("VmRSS")
    call()
    dist.barrier()
    return (_status("VmHWM") - before) / (NUMEL * 4)


def rank_values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    return torch.randn(NUMEL, generator=g)


def reduce_scatter(group) -> dict:
    ws, rank = group.size(), group.rank()
    x = rank_values(1)
    want, got = torch.zeros(NUMEL // ws), torch.zeros(NUMEL // ws)
    grew_default = peak_growth(lambda: dist.reduce_scatter_single(want, x.clone(), group=group))
    y = x.clone()  # consumed: the in-place call all-reduces it
    grew = peak_growth(lambda: InPlaceReduceScatter()(got, y, group, dist.ReduceOp.SUM))
    assert y.chunk(ws)[rank].data_ptr() != got.data_ptr()
    return {"equal": torch.equal(want, got), "grew_default": grew_default, "grew_in_place": grew}


def all_gather(group) -> dict:
    ws, rank = group.size(), group.rank()
    shard = rank_values(2)[: NUMEL // ws].clone()
    want, got = torch.zeros(NUMEL), torch.zeros(NUMEL)
    got.chunk(ws)[rank].copy_(shard)  # where FSDP2 copies the shard in
    grew_default = peak_growth(lambda: dist.all_gather_single(want, shard, group=group))
    in_place = InPlaceAllGather()

    def call():
        work = in_place(got, got.chunk(ws)[rank], group, async_op=True)
        work.wait()

    grew = peak_growth(call)
    return {"equal": torch.equal(want, got), "grew_default": grew_default, "grew_in_place": grew}


def fsdp_grads(in_place: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
        if in_place:
            use_in_place_comms(layer)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    model(torch.randn(4, 48, generator=g)).square().mean().backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    out = {"reduce_scatter": reduce_scatter(group), "all_gather": all_gather(group)}
    default, in_place = fsdp_grads(False), fsdp_grads(True)
    out["fsdp"] = {"equal": all(map(torch.equal, default, in_place)), "tensors": len(default)}
    print(json.dumps({"rank": dist.get_rank(), **out}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
