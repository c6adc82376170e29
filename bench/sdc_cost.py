"""What silent-data-corruption checks cost in steady state, and whether a clean run ever
raises one (docs/architecture.md, "Silent data corruption").

The same dp=2 job trained under torchrun three times per round: `sdc.enabled: false`, the
checks at their default interval without the state-at-rest check (`sdc.at_rest: false`), and
with it (the default: each rank seals and verifies its own state between every two steps,
worker/trainer/at_rest.py). At zero 0 (DP replicas with identical state) that is a
parameter fingerprint every step for the replay and every state tensor's fingerprint compared
across the replicas every `sdc.every_steps`; at `--zero 2` or `3` (no replicas) a re-execution
spot check every `sdc.spot_every_steps` (worker/trainer/spot_check.py). Rounds alternate so drift
on a shared host hits both arms alike. Step time is the gap between consecutive step records
of every rank after warm-up: it includes the checks, which run between steps. Its median
(the replica check's every-step cost) and, for spot checks, its mean: they run in one gap of
every `spot_every_steps`, which a median never sees.

    python bench/sdc_cost.py [--preset tiny] [--steps 400] [--rounds 2] [--zero 0]

Summary lines (stable):
    `sdc checks / none (<preset>): X.XXx (median step time)`                  (zero 0)
    `sdc spot checks / none (<preset>, zero Z): X.XXx (mean step time)`       (zero 2, 3)
    `sdc at-rest / checks without it (<preset>, zero Z): X.XXXx (median step time)`
    `sdc false positives (<preset>): N in C checks over S clean steps`
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import spec_file, torchrun  # noqa: E402
from services.spec import SdcSpec  # noqa: E402

WARMUP = 3


def job(preset: str, steps: int, checks: bool, zero: int, at_rest: bool = True) -> dict:
    return {
        "name": "bench-sdc",
        "model": {"preset": preset},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2, "zero": zero},
        "train": {"steps": steps, "global_batch": 16, "lr": 1e-3, "warmup_steps": 2},
        "sdc": {"enabled": checks, "at_rest": at_rest},
    }


def run(spec: dict) -> tuple[list[float], int]:
    """Every rank's step-to-step gaps after warm-up, and how many corruption lines it wrote."""
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        args = ["-m", "worker.trainer", "--spec", str(spec_file(spec, d))]
        args += ["--metrics-out", str(d / "steps-{rank}.jsonl"), "--quiet"]
        torchrun(2, args, check=False)
        gaps, found = [], 0
        for f in sorted(d.glob("steps-*.jsonl")):
            recs = [json.loads(line) for line in f.read_text().splitlines()]
            found += sum(r.get("event") == "sdc" for r in recs)
            steps = [r for r in recs if "step_s" in r and r["step"] > WARMUP]
            gaps += [b["time"] - a["time"] for a, b in itertools.pairwise(steps)]
        return gaps, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--zero", type=int, choices=(0, 2, 3), default=0, help="2 or 3: spot checks, no replicas"
    )
    a = ap.parse_args()
    every = SdcSpec().spot_every_steps if a.zero else SdcSpec().every_steps
    none, unsealed, checked, found = [], [], [], 0
    for i in range(a.rounds):
        none += run(job(a.preset, a.steps, False, a.zero))[0]
        unsealed += run(job(a.preset, a.steps, True, a.zero, at_rest=False))[0]
        gaps, n = run(job(a.preset, a.steps, True, a.zero))
        checked, found = checked + gaps, found + n
        print(
            f"  round {i + 1}: none {statistics.median(none) * 1e3:.2f} ms, "
            f"checks without at-rest {statistics.median(unsealed) * 1e3:.2f} ms, "
            f"checks {statistics.median(checked) * 1e3:.2f} ms (median)",
            flush=True,
        )
    m0, m1 = statistics.median(none), statistics.median(checked)
    a0, a1 = statistics.fmean(none), statistics.fmean(checked)
    print(
        f"model {a.preset}, dp=2 zero {a.zero}, {a.steps} steps x {a.rounds} rounds, every {every}"
    )
    print(f"  median step: none {m0 * 1e3:.2f} ms, checks {m1 * 1e3:.2f} ms")
    print(f"  mean step: none {a0 * 1e3:.2f} ms, checks {a1 * 1e3:.2f} ms")
    if a.zero:
        print(
            f"sdc spot checks / none ({a.preset}, zero {a.zero}): {a1 / a0:.3f}x (mean step time)"
        )
    else:
        print(f"sdc checks / none ({a.preset}): {m1 / m0:.3f}x (median step time)")
    mu = statistics.median(unsealed)
    print(
        f"sdc at-rest / checks without it ({a.preset}, zero {a.zero}): {m1 / mu:.3f}x "
        "(median step time)"
    )
    # spot checks skip the last step (nothing left to protect)
    n_checks = a.rounds * ((a.steps - 1) // every if a.zero else a.steps // every)
    print(
        f"sdc false positives ({a.preset}): {found} in {n_checks} checks over "
        f"{a.rounds * a.steps} clean steps"
    )


if __name__ == "__main__":
    main()
