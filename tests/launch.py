"""Launch the real trainer (its ranks started by tests/rankrun.py, the torchrun environment
without torchrun's launcher) and read back its per-step metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from services.procs import descendants

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TRAINING = ("model", "data", "parallel", "train", "checkpoint")  # what decides the numbers


def training_key(spec: dict) -> str:
    """Runs with equal keys train the same numbers (checkpoint.keep only decides pruning)."""
    key = {k: spec.get(k) for k in TRAINING}
    key["checkpoint"] = {k: v for k, v in (key["checkpoint"] or {}).items() if k != "keep"}
    return json.dumps(key, sort_keys=True)


def write_spec(spec: dict, directory: Path, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(spec))
    return path


def trainer_command(spec: dict, directory: Path, extra: list[str] = ()) -> list[str]:
    """dp*pp*tp local rank processes (tests/rankrun.py, torchrun's argument order); rank 0's
    metrics go to directory/steps.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    p = spec.get("parallel", {})
    nproc = p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)
    return [
        sys.executable,
        "-m",
        "tests.rankrun",
        f"--nproc-per-node={nproc}",
        "-m",
        "worker.trainer",
        "--spec",
        str(write_spec(spec, directory)),
        "--metrics-out",
        str(directory / "steps.jsonl"),
        "--quiet",
        *extra,
    ]


def run_trainer(
    spec: dict, directory: Path, *, extra: list[str] = (), timeout: float = 300, fresh: bool = True
) -> subprocess.CompletedProcess:
    if fresh:
        (directory / "steps.jsonl").unlink(missing_ok=True)
    proc = subprocess.run(
        trainer_command(spec, directory, extra),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        # the launcher names the first rank that failed; its own lines get lost behind the others'
        first = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank0]"))[
            -3000:
        ]
        raise AssertionError(
            f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"rank 0:\n{first}\nlast lines:\n{proc.stderr[-6000:]}"
        )
    return proc


def train(
    spec: dict, directory: Path, *, extra: list[str] = (), timeout: float = 300
) -> list[dict]:
    """Run the spec to the end; return rank 0's step records."""
    run_trainer(spec, directory, extra=extra, timeout=timeout)
    # one metrics file for every rank: no shared collective-counter file (each rank truncating
    # the one the others had mapped killed ranks with SIGBUS; worker/trainer/main.py)
    assert not (directory / "steps.jsonl.collectives").exists()
    return step_records(directory)


def start_trainer(spec: dict, directory: Path, extra: list[str] = ()) -> subprocess.Popen:
    """Start in its own session, so `kill_all` can SIGKILL every rank at once."""
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / "run.log").open("a")
    return subprocess.Popen(
        trainer_command(spec, directory, extra),
        cwd=ROOT,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank at once, as a node failure would."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for(
    what: str, predicate: Callable[[], bool], proc: subprocess.Popen, timeout: float = 240
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            kill_all(proc)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def read_records(directory: Path) -> list[dict]:
    path = directory / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def step_records(directory: Path) -> list[dict]:
    return [r for r in read_records(directory) if "step" in r and "event" not in r]


def summary(directory: Path) -> dict:
    return next(r for r in read_records(directory) if r.get("event") == "done")
