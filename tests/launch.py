"""Launch the real trainer under torchrun and read back its per-step metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_spec(spec: dict, directory: Path, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(spec))
    return path


def train(spec: dict, directory: Path, *, extra: list[str] = (), timeout: float = 300) -> list[dict]:
    """Run the spec on dp*pp*tp local processes; return rank 0's step records."""
    directory.mkdir(parents=True, exist_ok=True)
    p = spec.get("parallel", {})
    nproc = p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)
    metrics = directory / "steps.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "worker.train", "--spec", str(write_spec(spec, directory)),
           "--metrics-out", str(metrics), "--quiet", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [r for r in read_records(directory) if "step" in r]


def read_records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "steps.jsonl").read_text().splitlines()]


def summary(directory: Path) -> dict:
    return next(r for r in read_records(directory) if r.get("event") == "done")
