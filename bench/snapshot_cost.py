"""What per-step in-memory snapshots cost in steady state (docs/architecture.md, "Hot recovery").

The same dp=2 job trained under torchrun twice per round, without snapshots and with a snapshot
after every step (own ring in /dev/shm plus the copy sent to the buddy rank), rounds
alternating so drift on a shared host hits both arms alike. Step time is the median over
every rank's steps after the first few (warm-up), from one step's end to the next: it counts
what the training thread does between steps (capturing the state for a snapshot) too.

    python bench/snapshot_cost.py [--preset small] [--d-model 512 ...] [--steps 40] [--rounds 2]

Summary line (stable): `snapshots / none (<model>): X.XXx (median step time)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import spec_file, torchrun  # noqa: E402

WARMUP = 3


def job(model: dict, steps: int) -> dict:
    return {
        "name": "bench-snapshot",
        "model": model,
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2},
        "train": {"steps": steps, "global_batch": 4, "lr": 1e-3, "warmup_steps": 2},
    }


def run(spec: dict, snapshots: bool) -> tuple[list[float], int]:
    """Step times of every rank after warm-up, and one rank's snapshot size in bytes."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        d = Path(d)
        args = ["-m", "worker.trainer", "--spec", str(spec_file(spec, d))]
        args += ["--metrics-out", str(d / "steps-{rank}.jsonl"), "--quiet"]
        if snapshots:
            plan = {"dir": shm, "generation": 1, "every": 1, "keep": 2, "holders": {0: 1, 1: 0}}
            (d / "plan.json").write_text(json.dumps(plan))
            args += ["--snapshot-plan", str(d / "plan.json")]
        torchrun(2, args)
        times = []
        for f in sorted(d.glob("steps-*.jsonl")):
            ends = [
                r["time"]
                for r in map(json.loads, f.read_text().splitlines())
                if "step_s" in r and r["step"] > WARMUP
            ]
            times += [b - a for a, b in pairwise(ends)]
        size = sum(p.stat().st_size for p in Path(shm).glob("g1/r0/slot-0.bin"))
        return times, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--d-model", type=int, help="a custom model of --layers layers instead")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.d_model:
        model = {"layers": a.layers, "d_model": a.d_model, "heads": 8, "vocab": 4096}
        model["seq_len"] = 128
        name = f"{a.layers} layers, d_model {a.d_model}"
    else:
        model, name = {"preset": a.preset}, a.preset
    spec = job(model, a.steps)
    none, snap, size = [], [], 0
    for i in range(a.rounds):
        none += run(spec, False)[0]
        t, size = run(spec, True)
        snap += t
        print(
            f"  round {i + 1}: none {statistics.median(none) * 1e3:.1f} ms, "
            f"snapshots {statistics.median(snap) * 1e3:.1f} ms",
            flush=True,
        )
    m0, m1 = statistics.median(none), statistics.median(snap)
    print(
        f"model {name}, dp=2, {a.steps} steps x {a.rounds} rounds; a rank's snapshot "
        f"{size / 2**20:.1f} MiB (own slot; its buddy holds the same again)"
    )
    print(f"  median step: none {m0 * 1e3:.1f} ms, snapshots {m1 * 1e3:.1f} ms")
    print(f"snapshots / none ({name}): {m1 / m0:.2f}x (median step time)")


if __name__ == "__main__":
    main()
