"""Trainer entry point: `torchrun --nproc-per-node N -m worker.train --spec job.yaml`.

Also callable in-process as `main(argv)` (the agent's warm processes do that), with the
same torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
Without them it runs as a single process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from services.spec import SpecError, check_world_size, load_spec
from worker.checkpoint import Checkpointer, restored_line
from worker.ckpt_store import CheckpointStore, read_history
from worker.data import DataError
from worker.parallel import ParallelDims, RankContext
from worker.progress import Collectives, counters_path
from worker.trainer import NonFiniteError, StepResult, Trainer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m worker.train", description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="job spec (YAML or JSON)")
    ap.add_argument("--metrics-out", help="JSON lines, one per step; '{rank}' in the path = one file per rank")
    ap.add_argument("--checkpoint-root", help="checkpoint directory root (overrides checkpoint.root)")
    ap.add_argument("--generation", type=int, default=0,
                    help="the job's generation: checkpoints are written under g{generation}/ only")
    ap.add_argument("--job-id", help="the controller's job id, recorded as every checkpoint's writer "
                    "(default: the spec's name)")
    ap.add_argument("--restore-from", help="JSON file with the committed checkpoint pointers, newest "
                    "first (the agent writes it from Redis); without it a standalone run follows its "
                    "own {checkpoint root}/{name}/committed.json")
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    return ap.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # a plain single-process run
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Ranks share the host's cores; more threads than cores only thrash.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return rank, world, device


def shutdown_distributed() -> None:
    # Pipeline sends are asynchronous: a peer may still be reading when this rank is
    # done. Quiesce first, so no gloo worker thread still holds a tensor at teardown
    # (that ends in SIGABRT during interpreter finalization).
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


class MetricsWriter:
    def __init__(self, template: str | None, rank: int):
        self.file = None
        if template and ("{rank}" in template or rank == 0):
            path = Path(template.replace("{rank}", str(rank)))
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


def step_record(r: StepResult, rank: int) -> dict:
    return {"step": r.step, "loss": r.loss, "tokens_per_s": r.tokens / r.step_s, "step_s": r.step_s,
            "compute_s": r.compute_s, "wait_s": r.wait_s, "lr": r.lr, "grad_norm": r.grad_norm,
            "rank": rank, "time": time.time()}


def make_checkpointer(args, spec, trainer: Trainer, metrics: "MetricsWriter") -> Checkpointer | None:
    root = args.checkpoint_root or spec.checkpoint.root
    if not root:
        return None
    p = spec.parallel
    meta = {"job": spec.name, "torch": torch.__version__, "mesh": {"dp": p.dp, "pp": p.pp, "tp": p.tp}}
    store = CheckpointStore(root, spec.name, generation=args.generation, writer=args.job_id)
    history = read_history(args.restore_from) if args.restore_from else None
    return Checkpointer(trainer, store, mode=spec.checkpoint.mode, keep=spec.checkpoint.keep,
                        meta=meta, report=metrics.write, history=history)


def resume(ckpt: Checkpointer | None, spec, say, metrics: "MetricsWriter") -> int:
    """The first step to run: after the newest committed checkpoint that verifies, or 0."""
    t0 = time.perf_counter()
    restored = ckpt.restore() if ckpt else None
    if restored is None:
        return 0
    p = spec.parallel
    say(restored_line(restored, {"dp": p.dp, "pp": p.pp, "tp": p.tp}), flush=True)
    metrics.write({"event": "restored", "step": restored.step, "restore_s": time.perf_counter() - t0})
    return restored.step


def run(args: argparse.Namespace) -> int:
    started_at = time.time()
    spec = load_spec(args.spec)
    metrics = MetricsWriter(args.metrics_out, int(os.environ.get("RANK", 0)))
    # Milestones as they happen: the controller reads them as progress (a slow start is not
    # a hang) and turns them into a recovery's phase durations.
    metrics.write({"event": "started", "started_at": started_at})
    rank, world, device = init_distributed(timeout_s=max(60.0, spec.fault_tolerance.hang_after_s))
    try:
        check_world_size(spec, world)
        dims = ParallelDims(spec.parallel, device.type)
        ctx = RankContext(dims, dims.build_mesh(), rank, device)
        rendezvous_at = time.time()
        metrics.write({"event": "rendezvous", "rendezvous_at": rendezvous_at})
        trainer = Trainer(spec, ctx)
        # Collective progress for the agent, next to this rank's own metrics file. Only with a
        # per-rank template: without '{rank}' every rank would map the same file and truncate
        # it under the others (SIGBUS, "mmap length is greater than file size"), and no agent
        # reads it there anyway.
        if args.metrics_out and "{rank}" in args.metrics_out:
            trainer.collectives = Collectives(counters_path(args.metrics_out.replace("{rank}", str(rank))))
        say = print if rank == 0 else (lambda *a, **k: None)
        floor = trainer.batches.entropy_floor()
        say(f"[meshkeeper] {spec.name}: mesh dp={spec.parallel.dp} pp={spec.parallel.pp} "
            f"tp={spec.parallel.tp} zero={spec.parallel.zero}, {spec.train.steps} steps"
            + (f", entropy floor {floor:.4f} nats" if floor is not None else ""), flush=True)
        ckpt = make_checkpointer(args, spec, trainer, metrics)
        start = resume(ckpt, spec, say, metrics)
        metrics.write({"event": "ready", "ready_at": time.time(), "start_step": start})
        results: list[StepResult] = []
        every, steps = spec.checkpoint.every_steps, spec.train.steps
        for step in range(start, steps):
            r = trainer.train_step(step, before_update=ckpt.wait_staged if ckpt else lambda: None)
            results.append(r)
            metrics.write(step_record(r, rank))
            if not args.quiet:
                say(f"step {step + 1:>6}/{steps}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                    f"|g| {r.grad_norm:.3f}  {r.tokens / r.step_s:,.0f} tok/s  {r.step_s * 1e3:.0f} ms",
                    flush=True)
            if ckpt:
                ckpt.poll()
                if (step + 1) % every == 0 or step + 1 == steps:
                    ckpt.save(step + 1)
        if ckpt:
            ckpt.close()
        if not results:
            say(f"[meshkeeper] nothing to do: the checkpoint is at the last step ({steps})")
            return 0
        tps = sum(r.tokens for r in results) / sum(r.step_s for r in results)
        summary = {"event": "done", "final_loss": results[-1].loss, "entropy_floor": floor,
                   "tokens_per_s": tps, "steps": len(results)}
        metrics.write(summary)
        metrics.close()
        say(f"[meshkeeper] done: final loss {results[-1].loss:.4f}"
            + (f" (entropy floor {floor:.4f}, gap {results[-1].loss / floor - 1:+.1%})" if floor else "")
            + f", {tps:,.0f} tokens/s", flush=True)
        return 0
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (SpecError, DataError) as e:
        print(f"meshkeeper: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"meshkeeper: training stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
