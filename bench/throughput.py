"""Tokens/s of the meshkeeper trainer vs a plain DDP script, same model and batch, dp2.

.venv/bin/python bench/throughput.py [--preset small] [--steps 15]
"""

import argparse
import json
import tempfile
from pathlib import Path

from common import spec_file, torchrun, train_records

WARMUP = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    base = {
        "name": "bench",
        "model": {"preset": args.preset},
        "train": {"steps": args.steps, "global_batch": args.global_batch, "lr": 1e-3},
    }
    with tempfile.TemporaryDirectory() as d:
        spec = {**base, "parallel": {"dp": 2}}
        print(
            f"baseline: plain DDP, {args.preset}, dp2, global batch {args.global_batch}", flush=True
        )
        ddp = json.loads(
            torchrun(
                2,
                [
                    "bench/ddp_baseline.py",
                    "--spec",
                    str(spec_file(spec, Path(d))),
                    "--warmup",
                    str(WARMUP),
                ],
            )
            .strip()
            .splitlines()[-1]
        )["tokens_per_s"]
    print(f"  DDP                {ddp:>10,.0f} tokens/s")
    for zero in (0, 2, 3):
        recs = train_records({**base, "parallel": {"dp": 2, "zero": zero}})[WARMUP:]
        ours = sum(r["tokens_per_s"] * r["step_s"] for r in recs) / sum(r["step_s"] for r in recs)
        print(
            f"  meshkeeper zero={zero}  {ours:>10,.0f} tokens/s   ratio vs DDP {ours / ddp:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
