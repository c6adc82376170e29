"""What per-step in-memory snapshots cost in steady state (docs/architecture.md, "Hot recovery").

The same dp=2 job trained under torchrun twice per round, without snapshots and with a snapshot
after every step (own ring in /dev/shm plus the buddy rank's copy: both ranks on one host, so
a hard link to the ward's file), and with `--apart` a third time with each rank in memory of
its own, as on two hosts, so the buddy's copy goes through the network stack (loopback, on
these 2 cores), rounds alternating so drift on a shared host hits both arms alike. Step time
is the median over every rank's steps after the first few (warm-up), from one step's end to
the next: it counts what the training thread does between steps (capturing the state for a
snapshot) too.

    python bench/snapshot_cost.py [--preset small] [--d-model 512 ...] [--steps 40] [--rounds 2]

Summary lines (stable): `snapshots / none (<model>): X.XXx (median step time)`, and with
`--apart` `snapshots, buddy on another host / none (<model>): X.XXx (median step time)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ENV, ROOT, own_memory, spec_file, torchrun  # noqa: E402
from services.procs import free_port  # noqa: E402

WARMUP = 3


def job(model: dict, steps: int) -> dict:
    return {
        "name": "bench-snapshot",
        "model": model,
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2},
        "train": {"steps": steps, "global_batch": 4, "lr": 1e-3, "warmup_steps": 2},
    }


def run(spec: dict, snapshots: bool, apart: bool = False) -> tuple[list[float], int]:
    """Step times of every rank after warm-up, and one rank's snapshot size in bytes (0 when
    `apart`: each rank then runs in memory of its own, which this process cannot see)."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        d = Path(d)
        args = ["-m", "worker.trainer", "--spec", str(spec_file(spec, d))]
        args += ["--metrics-out", str(d / "steps-{rank}.jsonl"), "--quiet"]
        if snapshots:
            plan = {"dir": shm, "generation": 1, "every": 1, "keep": 2, "holders": {0: 1, 1: 0}}
            (d / "plan.json").write_text(json.dumps(plan))
            args += ["--snapshot-plan", str(d / "plan.json")]
        if apart:
            two_hosts(args)
        else:
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


def two_hosts(args: list[str]) -> None:
    """The two ranks as if on two hosts: each in memory of its own (bench/common.py), so the
    buddy copies cross the network stack (loopback here) instead of being memory copies."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    env |= {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    procs = [
        subprocess.Popen(
            own_memory([sys.executable, *args]),
            cwd=ROOT,
            env={**env, "RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errors = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"benchmark run on two hosts failed:\n{errors[0][-1500:]}\n{errors[1][-1500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--d-model", type=int, help="a custom model of --layers layers instead")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--apart",
        action="store_true",
        help="also run each rank in memory of its own (needs root): the buddy copies then go "
        "through the network stack, as between two hosts",
    )
    a = ap.parse_args()
    if a.d_model:
        model = {"layers": a.layers, "d_model": a.d_model, "heads": 8, "vocab": 4096}
        model["seq_len"] = 128
        name = f"{a.layers} layers, d_model {a.d_model}"
    else:
        model, name = {"preset": a.preset}, a.preset
    spec = job(model, a.steps)
    none, snap, apart, size = [], [], [], 0
    for i in range(a.rounds):
        none += run(spec, False)[0]
        t, size = run(spec, True)
        snap += t
        line = f"  round {i + 1}: none {statistics.median(none) * 1e3:.1f} ms, snapshots "
        line += f"{statistics.median(snap) * 1e3:.1f} ms"
        if a.apart:
            apart += run(spec, True, apart=True)[0]
            line += f", buddy on another host {statistics.median(apart) * 1e3:.1f} ms"
        print(line, flush=True)
    m0, m1 = statistics.median(none), statistics.median(snap)
    print(
        f"model {name}, dp=2, {a.steps} steps x {a.rounds} rounds; a rank's snapshot "
        f"{size / 2**20:.1f} MiB (own slot; on one host its buddy links the same file)"
    )
    print(f"  median step: none {m0 * 1e3:.1f} ms, snapshots {m1 * 1e3:.1f} ms")
    print(f"snapshots / none ({name}): {m1 / m0:.2f}x (median step time)")
    if a.apart:
        m2 = statistics.median(apart)
        print(
            f"snapshots, buddy on another host / none ({name}): {m2 / m0:.2f}x (median step time)"
        )


if __name__ == "__main__":
    main()
