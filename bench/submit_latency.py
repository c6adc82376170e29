"""Time from `POST /v1/jobs` to the job's first training step: warm trainers vs cold start.

Both arms run in this invocation on the same machine: a local stack whose agents keep one warm
trainer each (torch and the trainer already imported), then one whose agents start trainers
cold (--warm 0). Each trial submits a dp=2 tiny job and polls GET /v1/jobs/{id} every 20 ms
until step >= 1. Prints the medians and the cold/warm ratio.

    python bench/submit_latency.py [--trials 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.control_plane import TINY, local_stack, median, wait_idle, warm_ready  # noqa: E402

WORKERS = 2


def time_to_first_step(client, spec: dict) -> float:
    t0 = time.perf_counter()
    job = client.submit(spec).id
    while True:
        j = client.job(job)
        if j.step >= 1:
            first = time.perf_counter() - t0
            break
        if j.phase in ("Failed", "Cancelled"):
            raise SystemExit(f"bench job {job} ended {j.phase}: {j.conditions}")
        time.sleep(0.02)
    while client.job(job).phase not in ("Succeeded", "Failed", "Cancelled"):
        time.sleep(0.1)
    return first


def arm(warm: int, trials: int) -> list[float]:
    out = []
    with local_stack(WORKERS, warm=warm) as (stack, client):
        for i in range(trials):
            if warm:
                warm_ready(stack, WORKERS * (i + 1))  # each job uses up one per worker
            wait_idle(client, WORKERS)
            out.append(time_to_first_step(client, TINY))
            print(f"  {'warm' if warm else 'cold'} trial {i + 1}: {out[-1]:.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    warm = arm(1, args.trials)
    cold = arm(0, args.trials)
    w, c = median(warm), median(cold)
    print(f"submit -> first step, dp=2 tiny job, median of {args.trials}:")
    print(f"  warm trainers: {w:6.2f} s")
    print(f"  cold start:    {c:6.2f} s   (baseline)")
    print(f"  cold / warm:   {c / w:6.2f}x")


if __name__ == "__main__":
    main()
