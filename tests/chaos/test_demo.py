"""`meshkeeper demo` end to end, as a user runs it with its output in a log (not a terminal):
a stack, a job, a rank SIGKILLed mid-run, the recovery. Each step's line is printed once,
in order, with that step's own loss (what rank 0 recorded for it), and the job succeeds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.procs import free_port
from tests.launch import ROOT

pytestmark = pytest.mark.slow

# dp2 of the `small` preset on three workers: slow enough on two cores (about 1 s a step)
# that the demo's kill lands mid-run, small enough for CI
SPEC = """\
name: demo-dp2
model: {preset: small}
data: {source: synthetic, seed: 7}
parallel: {dp: 2}
train: {steps: 30, global_batch: 16, lr: 2.0e-3, warmup_steps: 4}
checkpoint: {every_steps: 5, keep: 2, mode: async}
fault_tolerance: {spares: 1, heartbeat_s: 0.5, dead_after_s: 3.0, hang_after_s: 60}
"""
STEP_LINE = re.compile(r"^step (\d+)/30  loss (\S+) ")


def recorded_losses(run_dir: Path) -> dict[int, str]:
    """Each step's loss as rank 0 recorded it, in every generation (a redone step has the
    same bits: resume is exact), formatted as the CLI prints it."""
    losses: dict[int, set[str]] = {}
    for path in run_dir.glob("workers/*/jobs/*/g*/metrics-0.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record and "step" in record:
                losses.setdefault(record["step"], set()).add(format(record["loss"], ".4f"))
    assert all(len(v) == 1 for v in losses.values()), losses
    return {step: v.pop() for step, v in losses.items()}


def test_the_demo_prints_each_step_once_with_its_own_loss(tmp_path):
    spec = tmp_path / "demo.yaml"
    spec.write_text(SPEC)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "demo", "--workers", "3", "--port", str(free_port())]
        + ["--run-dir", str(run_dir), "--spec", str(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert ">>> demo: SIGKILL rank 1" in out and "Succeeded" in out, out[-3000:]
    printed = [
        (int(m.group(1)), m.group(2)) for line in out.splitlines() if (m := STEP_LINE.match(line))
    ]
    steps = [step for step, _ in printed if step > 0]
    assert len(steps) >= 5 and steps == sorted(set(steps)), steps  # each once, in order
    losses = recorded_losses(run_dir)
    for step, loss in printed:
        if step > 0:
            assert loss == losses[step], (step, loss, losses.get(step))
