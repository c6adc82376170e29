"""Measured pipeline bubble vs the theory (K-1)/(M+K-1), for pp K and M microbatches, and the
planner's prediction (services/planner on the `cpu` profile: the share of the step it expects a
rank to spend not computing: the bubble and the stage-to-stage sends).

A rank's bubble is the share of its step it spent blocked rather than computing
(worker/trainer/timing.py: CPU demand vs wall time), averaged over ranks and steps.

    .venv/bin/python bench/bubble.py [--steps 8]
"""

import argparse
import statistics

from common import train_records

from services.planner import Layout, cluster
from services.planner.cost import step_cost
from services.spec import parse_spec

WARMUP = 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print(
        f"{'schedule':<10}{'pp':>3}{'M':>4}{'theory':>9}{'measured':>10}{'ratio':>7}{'planner':>9}"
    )
    for pp in (2, 4):
        for m in (pp, 2 * pp, 4 * pp):
            spec = {
                "name": "bubble",
                "model": {"preset": "tiny", "layers": 8, "seq_len": 64},
                "parallel": {"pp": pp, "microbatches": m, "pp_schedule": "1f1b"},
                "train": {"steps": args.steps, "global_batch": 4 * m, "lr": 1e-3},
            }
            recs = [r for r in train_records(spec, per_rank=True) if r["step"] > WARMUP]
            measured = statistics.mean(r["wait_s"] / r["step_s"] for r in recs)
            theory = (pp - 1) / (m + pp - 1)
            parsed = parse_spec(spec)
            cost = step_cost(parsed, Layout.of(parsed.parallel), cluster("cpu", pp, 1, 2**34))
            predicted = (cost.bubble_s + cost.pp_s) / cost.step_time_s
            print(
                f"{'1f1b':<10}{pp:>3}{m:>4}{theory:>9.3f}{measured:>10.3f}"
                f"{measured / theory:>7.2f}{predicted:>9.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
