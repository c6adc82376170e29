"""Predicted per-rank memory (services/planner) against the measured peak of every rank.

Each layout trains a few steps under torchrun; every rank's step records carry
`peak_mem_bytes` (on CPU the process's own peak resident pages: VmHWM less the pages it
shares, worker/peak_rss.py `high_water_mark`). The planner's prediction for a rank's pipeline
position (first, last, or the only one) is compared with the largest peak measured at that
position.

    .venv/bin/python bench/planner_memory.py [--steps 3] [--preset small] [--layouts NAME ...]
"""

import argparse

from common import train_records

from services.mesh import MeshShape
from services.planner import Layout, cluster
from services.planner.memory import memory_at
from services.spec import parse_spec

MiB = 2**20
LAYOUTS = {
    "single": {},
    "dp2-zero0": {"dp": 2, "zero": 0},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2": {"tp": 2},
    "pp2-gpipe": {"pp": 2, "microbatches": 4, "pp_schedule": "gpipe"},
    "pp2-1f1b": {"pp": 2, "microbatches": 4, "pp_schedule": "1f1b"},
    "pp2-interleaved": {
        "pp": 2,
        "microbatches": 4,
        "pp_schedule": "interleaved_1f1b",
        "virtual_stages": 2,
    },
    "dp2-ac": {"dp": 2, "activation_checkpointing": True},
    "dp2-sac": {"dp": 2, "activation_checkpointing": "selective"},
    "dp2xpp2xtp2": {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2},
}


def position(rank: int, shape: MeshShape) -> str:
    pp = shape.coord(rank).pp
    return "only" if shape.pp == 1 else "first" if pp == 0 else "last" if pp == shape.pp - 1 else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = ap.parse_args()
    where = cluster("cpu", 8, 1, 2**40)  # memory is what is measured here, not a limit
    print(f"{'layout':<18}{'rank':>6}{'predicted MiB':>15}{'measured MiB':>14}{'ratio':>7}")
    worst = 0.0
    for name in args.layouts:
        parallel = LAYOUTS[name]
        raw = {
            "name": "mem",
            "model": {"preset": args.preset},
            "parallel": parallel,
            "train": {"steps": args.steps, "global_batch": args.batch, "lr": 1e-3},
        }
        spec = parse_spec(raw)
        shape = MeshShape(spec.parallel.dp, spec.parallel.pp, spec.parallel.tp)
        peaks: dict[str, int] = {}
        for r in train_records(raw, per_rank=True):
            pos = position(r["rank"], shape)
            if pos:
                peaks[pos] = max(peaks.get(pos, 0), r["peak_mem_bytes"])
        for pos, measured in sorted(peaks.items()):
            predicted = memory_at(spec, Layout.of(spec.parallel), where, pos).total
            ratio = predicted / measured
            worst = max(worst, abs(ratio - 1))
            print(
                f"{name:<18}{pos:>6}{predicted / MiB:>15.1f}{measured / MiB:>14.1f}{ratio:>7.2f}",
                flush=True,
            )
    print(f"largest deviation: {worst:.1%}")


if __name__ == "__main__":
    main()
