"""What a pipelined job's first step costs over its later ones, and how much of that is torch's
stage metadata inference (docs/fault-tolerance.md, "The pipeline's first step"). Every
generation builds new stages, so a recovery of a pipelined job pays it again.

Each rank runs the real trainer with the four `PipelineStage` methods of the inference (the
warm-up vote both ways, the forward and the backward metadata inference) timed; the baseline,
measured in the same run, is the median of the later steps.

    .venv/bin/python bench/pipeline_first_step.py [--presets tiny small] [--microbatches 4]

One summary line per preset:
`pipeline first step <preset> pp2 M4: inference X ms of Y ms over a later step (Z.ZZx)`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import spec_file, torchrun

INFERENCE = (
    "_warmup_forward_vote",
    "_warmup_backward_result",
    "_forward_metadata_inference",
    "_backward_metadata_inference",
)


def rank_side(argv: list[str]) -> int:
    """One rank: the trainer with the inference timed; its total printed as a JSON line."""
    from torch.distributed.pipelining.stage import PipelineStage

    spent = [0.0]

    def timed(method):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        return run

    for name in INFERENCE:
        setattr(PipelineStage, name, timed(getattr(PipelineStage, name)))
    from worker.trainer.main import main

    try:
        return main(argv)
    finally:
        print(json.dumps({"rank": os.environ.get("RANK"), "inference_s": spent[0]}), flush=True)


def measure(preset: str, microbatches: int, steps: int) -> None:
    spec = {
        "name": "pipeline-first-step",
        "model": {"preset": preset},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"pp": 2, "microbatches": microbatches},
        "train": {"steps": steps, "global_batch": 4 * microbatches, "lr": 1e-3},
    }
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        out = torchrun(
            2,
            [
                __file__,
                "--rank-side",
                "--spec",
                str(spec_file(spec, d)),
                "--metrics-out",
                str(d / "steps.jsonl"),
                "--quiet",
            ],
        )
        recs = list(map(json.loads, (d / "steps.jsonl").read_text().splitlines()))
    steps_s = [r["step_s"] for r in recs if "step_s" in r]
    inference = max(
        json.loads(line)["inference_s"] for line in out.splitlines() if '"inference_s"' in line
    )
    first, later = steps_s[0], statistics.median(steps_s[1:])
    over = first - later
    print(
        f"  {preset}: first step {first * 1e3:.0f} ms, later steps {later * 1e3:.0f} ms "
        f"(median of {len(steps_s) - 1}), inference {inference * 1e3:.0f} ms per rank (slowest)"
    )
    print(
        f"pipeline first step {preset} pp2 M{microbatches}: inference {inference * 1e3:.0f} ms "
        f"of {over * 1e3:.0f} ms over a later step ({inference / over:.2f}x)",
        flush=True,
    )


def main() -> None:
    if sys.argv[1:2] == ["--rank-side"]:
        sys.exit(rank_side(sys.argv[2:]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    for preset in args.presets:
        measure(preset, args.microbatches, args.steps)


if __name__ == "__main__":
    main()
