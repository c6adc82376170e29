"""Checkpoint cost on the `small` preset at dp2: async vs sync blocking time, and restore.

Blocking time is what the training loop waits per save (staging included for async);
it is printed as a ratio (async / sync) and as a fraction of the mean step time.

    .venv/bin/python bench/checkpoint.py [--steps 12] [--every 3]
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import spec_file, torchrun


def run(mode: str, root: Path, steps: int, every: int) -> tuple[list[dict], Path]:
    spec = {
        "name": "bench-ckpt",
        "model": {"preset": "small"},
        "parallel": {"dp": 2},
        "train": {"steps": steps, "global_batch": 8, "lr": 1e-3},
        "checkpoint": {"every_steps": every, "keep": 2, "mode": mode},
    }
    out = root / f"{mode}.jsonl"
    torchrun(
        2,
        [
            "-m",
            "worker.trainer",
            "--spec",
            str(spec_file(spec, root)),
            "--metrics-out",
            str(out),
            "--quiet",
            "--checkpoint-root",
            str(root / mode),
        ],
    )
    return [json.loads(x) for x in out.read_text().splitlines()], out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        results = {}
        for mode in ("sync", "async"):
            records, _ = run(mode, root, args.steps, args.every)
            saves = [r for r in records if r.get("event") == "checkpoint"]
            steps = [r["step_s"] for r in records if "loss" in r][1:]
            results[mode] = (
                statistics.median(s["blocking_s"] for s in saves),
                statistics.median(s["total_s"] for s in saves),
                statistics.mean(steps),
            )
        print(f"{'mode':<6}{'blocking/save':>15}{'total/save':>12}{'step':>9}{'blocking/step':>15}")
        for mode, (block, total, step) in results.items():
            print(
                f"{mode:<6}{block * 1e3:>13.0f}ms{total * 1e3:>10.0f}ms{step * 1e3:>7.0f}ms"
                f"{block / step:>15.2f}"
            )
        print(f"async/sync blocking ratio: {results['async'][0] / results['sync'][0]:.3f}")
        records, _ = run("async", root, args.steps, args.every)  # same root: restores the last save
        restore = next(r for r in records if r.get("event") == "restored")
        print(
            f"restore of step {restore['step']} (dp2, small): {restore['restore_s']:.2f}s "
            f"= {restore['restore_s'] / results['async'][2]:.1f} steps"
        )


if __name__ == "__main__":
    main()
