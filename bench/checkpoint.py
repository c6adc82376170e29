"""Checkpoint cost at dp2: async vs sync blocking time and restore on the `small` preset,
then a checkpoint of several GB saved, verified and restored.

Blocking time is what the training loop waits per save (staging included for async);
it is printed as a ratio (async / sync) and as a fraction of the mean step time.

The large run (`--large-layers`, d_model 2048: 5 layers is a ~3 GB checkpoint with Adam)
saves at step 2 and restores it in a second run. Its baseline, measured in the same
invocation on the same files, is what the previous design did on rank 0's training thread
while every other rank waited in a collective (60 s timeout): hash every file with one
thread, once at commit and again at restore. Both runs must finish without a failed save
or a timed-out collective, or the benchmark exits non-zero.

    .venv/bin/python bench/checkpoint.py [--steps 12] [--every 3] [--large-layers 5]
"""

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import spec_file, torchrun

SMALL = {"preset": "small"}


def run(
    mode: str, root: Path, steps: int, every: int, model: dict = SMALL, name: str = "run"
) -> list[dict]:
    spec = {
        "name": "bench-ckpt",
        "model": model,
        "parallel": {"dp": 2},
        "train": {"steps": steps, "global_batch": 8, "lr": 1e-3, "warmup_steps": 1},
        "checkpoint": {"every_steps": every, "keep": 2, "mode": mode},
    }
    out = root / f"{mode}-{name}.jsonl"
    torchrun(  # exits non-zero when a rank failed, a timed-out collective included
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
    return [json.loads(x) for x in out.read_text().splitlines()]


def sha256_one_thread(files: list[Path]) -> float:
    """Seconds to hash `files` one after another on one thread (the previous design)."""
    t0 = time.perf_counter()
    for f in files:
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(8 << 20), b""):
                h.update(chunk)
    return time.perf_counter() - t0


def large(layers: int) -> None:
    model = {"layers": layers, "d_model": 2048, "heads": 16, "vocab": 1024, "seq_len": 32}
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        root = Path(d)
        saved = run("async", root, 2, 2, model, "large-save")
        step_dir = next((root / "async").glob("bench-ckpt/g*/step-00000002"))
        files = [p for p in step_dir.rglob("*") if p.is_file() and ".digests" not in p.parts]
        size = sum(p.stat().st_size for p in files)
        resumed = run("async", root, 3, 3, model, "large-restore")
        events = [r.get("event") for r in saved + resumed]
        save = next(r for r in saved if r.get("event") == "checkpoint" and r["step"] == 2)
        restore = next(r for r in resumed if r.get("event") == "restored")
        baseline = sha256_one_thread(files)
        print(f"large checkpoint: {size / 1e9:.2f} GB in {len(files)} files (dp2, {layers} layers)")
        print(
            f"save: blocking {save['blocking_s']:.2f}s, committed (written, hashed by each "
            f"rank, manifest) {save['total_s']:.2f}s after it began"
        )
        print(f"restore with verification: {restore['restore_s']:.2f}s")
        print(
            f"baseline, one thread hashing every file on rank 0: {baseline:.2f}s at commit "
            f"and again at restore, with the other ranks held in a collective"
        )
        failed = events.count("checkpoint_failed") + events.count("checkpoint_skipped")
        # torchrun() already exited non-zero had any rank failed (a timed-out collective too)
        print(
            f"failed or skipped checkpoints: {failed}; both runs exited 0: no collective timed out"
        )
        if failed or restore["step"] != 2:
            raise SystemExit("large checkpoint: a save failed or a collective timed out")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--large-layers", type=int, default=5, help="0 skips the large checkpoint")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        results = {}
        for mode in ("sync", "async"):
            records = run(mode, root, args.steps, args.every)
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
        records = run(
            "async", root, args.steps, args.every, name="restore"
        )  # same root: restores the last save
        restore = next(r for r in records if r.get("event") == "restored")
        print(
            f"restore of step {restore['step']} (dp2, small): {restore['restore_s']:.2f}s "
            f"= {restore['restore_s'] / results['async'][2]:.1f} steps"
        )
    if args.large_layers:
        large(args.large_layers)


if __name__ == "__main__":
    main()
