"""Run as 2 ranks (tests/rankrun.py or torchrun): TP-sharded Attention / MLP vs unsharded.

Prints one JSON line per block on rank 0 with the L2 differences of the output and of
every weight gradient (sharded gradients gathered with full_tensor()).
"""

import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from services.spec import ModelSpec
from worker.trainer.distributed import shutdown_distributed
from worker.trainer.model import build_model, rope_tables

PLANS = {
    "mlp": {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()},
    "attention": {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(),
    },
}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    cfg = ModelSpec(preset="tiny")
    layer = build_model(cfg, seed=0).layers["0"]  # the model's own init, same on every rank
    blocks = {"mlp": layer.mlp, "attention": layer.attn}
    x = torch.randn(3, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_tables(cfg)
    for name, ref in blocks.items():
        tp = parallelize_module(copy.deepcopy(ref), mesh, PLANS[name])
        args = (cos, sin) if name == "attention" else ()
        out_ref, out_tp = ref(x, *args), tp(x, *args)
        out_ref.square().sum().backward()
        out_tp.square().sum().backward()
        grads = {}
        for (n, p_ref), (_, p_tp) in zip(
            ref.named_parameters(), tp.named_parameters(), strict=True
        ):
            g = p_tp.grad.full_tensor() if isinstance(p_tp.grad, DTensor) else p_tp.grad
            grads[n] = float((g - p_ref.grad).norm())
        sharded = all(isinstance(p, DTensor) for p in tp.parameters())
        if dist.get_rank() == 0:
            print(
                json.dumps(
                    {
                        "block": name,
                        "out_l2": float((out_tp - out_ref).norm()),
                        "grad_l2": grads,
                        "sharded": sharded,
                        "grad_scale": float(out_ref.norm()),
                    }
                )
            )
    # barrier, then destroy: a rank tearing gloo down while its peer still reads ends in
    # "terminate called without an active exception" (SIGABRT), seen in a full run
    shutdown_distributed()


if __name__ == "__main__":
    main()
