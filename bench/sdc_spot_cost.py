"""What one re-execution spot check costs next to a training step, measured inside the
trainer's ranks (worker/trainer/spot_check.py; docs/architecture.md, "Silent data
corruption").

A dp=2 job without replicas (zero 3 by default) on 2 local ranks: each round times one
`train_step` and one `SpotCheck.verify` back to back, every rank starting both at a barrier,
so drift on a shared host hits both alike (bench/sdc_cost.py measures the whole run instead,
and its means need a quiet host). The amortized cost at the default interval is
check / (spot_every_steps * step).

    python bench/sdc_spot_cost.py [--preset tiny] [--zero 3] [--rounds 40]

Summary lines (stable):
    `sdc spot check / step (<preset>, zero Z): X.XXx (median)`
    `sdc spot checks at spot_every_steps N (<preset>, zero Z): +X.X% step time`
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import spec_file, torchrun  # noqa: E402
from services.spec import SdcSpec  # noqa: E402

WARMUP = 3


def job(preset: str, zero: int, rounds: int) -> dict:
    return {
        "name": "bench-spot",
        "model": {"preset": preset},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2, "zero": zero},
        "train": {"steps": 2 * (rounds + WARMUP), "global_batch": 16, "lr": 1e-3},
        "sdc": {"spot_every_steps": 1},  # a check may run after any step here
    }


def ranks(spec_path: str) -> None:
    """One rank: rounds of (step, check); rank 0 prints the times as one JSON line."""
    import torch.distributed as dist

    from services.spec import load_spec
    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.spot_check import SpotCheck
    from worker.trainer.step import Trainer

    spec = load_spec(spec_path)
    rank, _, device = init_distributed(timeout_s=60)
    try:
        dims = ParallelDims(spec.parallel, device.type)
        trainer = Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device))
        spot = SpotCheck(spec, trainer)
        steps, checks = [], []
        for i in range(spec.train.steps // 2):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step(i)
            dist.barrier()
            t1 = time.perf_counter()
            spot.verify(i + 1)
            dist.barrier()
            if i >= WARMUP:
                steps.append(t1 - t0)
                checks.append(time.perf_counter() - t1)
        if rank == 0:
            print(json.dumps({"steps": steps, "checks": checks}), flush=True)
    finally:
        shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--zero", type=int, choices=(2, 3), default=3)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--ranks", metavar="SPEC", help=argparse.SUPPRESS)  # the rank side
    a = ap.parse_args()
    if a.ranks:
        ranks(a.ranks)
        return
    with tempfile.TemporaryDirectory() as d:
        path = spec_file(job(a.preset, a.zero, a.rounds), Path(d))
        out = torchrun(2, [str(Path(__file__).resolve()), "--ranks", str(path)])
    times = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    ratios = [c / s for s, c in zip(times["steps"], times["checks"], strict=True)]
    step, check = statistics.median(times["steps"]), statistics.median(times["checks"])
    ratio, every = statistics.median(ratios), SdcSpec().spot_every_steps
    print(f"model {a.preset}, dp=2 zero {a.zero}, {a.rounds} rounds of (step, check)")
    print(f"  median: step {step * 1e3:.2f} ms, spot check {check * 1e3:.2f} ms")
    print(f"sdc spot check / step ({a.preset}, zero {a.zero}): {ratio:.3f}x (median)")
    print(
        f"sdc spot checks at spot_every_steps {every} ({a.preset}, zero {a.zero}): "
        f"+{ratio / every:.1%} step time"
    )


if __name__ == "__main__":
    main()
