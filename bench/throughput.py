"""Tokens/s of the meshkeeper trainer vs a plain DDP script, same model and batches, dp2.

.venv/bin/python bench/throughput.py [--preset small] [--steps 15] [--rounds 3]

The runs are interleaved (DDP, zero=0, zero=2, zero=3, then again) and each keeps its best
round: on a shared machine other work only ever slows a run down, so the best round is the
one closest to the machine's own speed, and interleaving gives every configuration the same
chances. The final losses must agree: same batches, same numbers (bench/ddp_baseline.py).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import spec_file, torchrun, train_records

WARMUP = 3
ZEROS = (0, 2, 3)


def ddp_run(spec: dict) -> tuple[float, float]:
    """(tokens/s, final loss) of the plain DDP baseline."""
    with tempfile.TemporaryDirectory() as d:
        target = ["bench/ddp_baseline.py", "--spec", str(spec_file(spec, Path(d)))]
        out = torchrun(2, [*target, "--warmup", str(WARMUP)])
    r = json.loads(out.strip().splitlines()[-1])
    return r["tokens_per_s"], r["final_loss"]


def meshkeeper_run(spec: dict) -> tuple[float, float]:
    """(tokens/s over the steps after warmup, final loss) of the real trainer."""
    records = train_records(spec)
    timed = records[WARMUP:]
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in timed)
    return tokens / sum(r["step_s"] for r in timed), records[-1]["loss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs; each keeps its best")
    args = ap.parse_args()
    base = {
        "name": "bench",
        "model": {"preset": args.preset},
        "train": {"steps": args.steps, "global_batch": args.global_batch, "lr": 1e-3},
    }
    print(f"baseline: plain DDP, {args.preset}, dp2, global batch {args.global_batch}", flush=True)
    print(f"  best of {args.rounds} interleaved rounds", flush=True)
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        runs.setdefault("DDP", []).append(ddp_run({**base, "parallel": {"dp": 2}}))
        for zero in ZEROS:
            spec = {**base, "parallel": {"dp": 2, "zero": zero}}
            runs.setdefault(f"zero={zero}", []).append(meshkeeper_run(spec))
    best = {name: max(tps for tps, _ in results) for name, results in runs.items()}
    ddp = best["DDP"]
    print(f"  DDP                {ddp:>10,.0f} tokens/s")
    for zero in ZEROS:
        ours = best[f"zero={zero}"]
        print(
            f"  meshkeeper zero={zero}  {ours:>10,.0f} tokens/s   ratio vs DDP {ours / ddp:.2f}",
            flush=True,
        )
    losses = {name: results[0][1] for name, results in runs.items()}
    print("  final loss: " + ", ".join(f"{name} {loss:.6f}" for name, loss in losses.items()))
    if max(losses.values()) - min(losses.values()) > 1e-4 * max(losses.values()):
        sys.exit("the final losses differ: the runs did not train on the same batches")


if __name__ == "__main__":
    main()
