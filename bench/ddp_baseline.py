"""The baseline for bench/throughput.py: a plain DDP loop doing the trainer's training on the
same batches (the same model and initial weights, AdamW settings, gradient clipping and LR
schedule, so its final loss is meshkeeper's), without the service around it.

Run under torchrun; prints one JSON line on rank 0: {"tokens_per_s": ..., "final_loss": ...}.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from services.spec import load_spec
from worker.trainer.data import Batches
from worker.trainer.model import build_model
from worker.trainer.optim import build_optimizer, build_scheduler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    spec = load_spec(args.spec)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = DistributedDataParallel(build_model(spec.model, spec.train.seed))
    opt = build_optimizer(list(model.parameters()), spec.train)
    sched = build_scheduler(opt, spec.train)
    batches = Batches(spec.data, spec.model, spec.train.global_batch, world)
    timed, tokens = 0.0, 0
    for step in range(spec.train.steps):
        t0 = time.perf_counter()
        x, y = batches.local(step, rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if spec.train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            timed += time.perf_counter() - t0
            tokens += spec.train.global_batch * spec.model.seq_len
    final = loss.detach().double() / world  # the global batch's mean, as the trainer reports
    dist.all_reduce(final)
    if rank == 0:
        print(json.dumps({"tokens_per_s": tokens / timed, "final_loss": float(final)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
