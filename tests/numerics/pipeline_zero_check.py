"""Run as 4 ranks (tests/rankrun.py): dp2 x pp2 at the zero level in argv[1], one training step
of 2 microbatches, recording after every microbatch's backward whether the stage's FSDP
parameters are sharded and whether its sharded gradients exist yet.

Prints one JSON line per rank: {"zero", "pp", "after_backward": [{"sharded", "grads"}, ...]}.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from services.spec import parse_spec
from worker.trainer.distributed import shutdown_distributed
from worker.trainer.parallel import ParallelDims, RankContext
from worker.trainer.pipeline import ShardedStage
from worker.trainer.step import Trainer


def fsdp_params(module):
    state = module._get_fsdp_state()
    return [p for group in state._fsdp_param_groups for p in group.fsdp_params]


def main() -> None:
    zero = int(sys.argv[1])
    dist.init_process_group("gloo")
    spec = parse_spec(
        {
            "name": "pipeline-zero",
            "model": {"preset": "tiny", "layers": 2},
            "data": {"source": "synthetic", "seed": 1},
            "parallel": {"dp": 2, "pp": 2, "microbatches": 2, "zero": zero},
            "train": {"steps": 1, "global_batch": 4},
        }
    )
    dims = ParallelDims(spec.parallel, "cpu")
    ctx = RankContext(dims, dims.build_mesh(), dist.get_rank(), torch.device("cpu"))
    trainer = Trainer(spec, ctx)
    seen = []
    backward = ShardedStage.backward_maybe_with_nosync

    def recording(stage, *args, **kwargs):
        out = backward(stage, *args, **kwargs)
        blocks = [m for m in stage.submod.modules() if hasattr(m, "_get_fsdp_state")]
        params = [p for m in blocks for p in fsdp_params(m)]
        seen.append(
            {
                "sharded": all(p.sharded_state == ShardedState.SHARDED for p in params),
                # the reduce-scattered gradient, not the module's (unsharded while gathered)
                "grads": all(p.sharded_param.grad is not None for p in params),
            }
        )
        return out

    ShardedStage.backward_maybe_with_nosync = recording
    trainer.train_step(0)
    print(json.dumps({"zero": zero, "pp": ctx.coord.pp, "after_backward": seen}), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
