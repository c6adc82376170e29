"""Helpers shared by the benchmarks: run the real trainer under torchrun, read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, target: list[str], check: bool = True) -> str:
    """stdout of `target` on `nproc` local ranks; with `check`, a failed run ends the bench."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *target,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if check and proc.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(target)}\n{proc.stderr[-3000:]}")
    return proc.stdout


def own_memory(argv: list[str], size: str = "8g") -> list[str]:
    """`argv` run as on a host of its own, as far as memory goes: in a mount namespace of its
    own with a fresh tmpfs on /dev/shm. No process outside sees its snapshots, and they are
    freed when its last process exits, as a host's memory is when the host dies. Needs root
    (CAP_SYS_ADMIN), as network namespaces do."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def start_apart(argv: list[str], world: int, port: int) -> list[subprocess.Popen]:
    """`world` ranks of `argv` (torch's env:// rendezvous on `port`), each as on a host of its
    own (`own_memory`); stdout and stderr piped, as text."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    env |= {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    return [
        subprocess.Popen(
            own_memory(argv),
            cwd=ROOT,
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def spec_file(spec: dict, directory: Path) -> Path:
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def train_records(spec: dict, per_rank: bool = False) -> list[dict]:
    """Step records of the real trainer (every rank's if per_rank)."""
    p = spec.get("parallel", {})
    nproc = p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        out = d / ("steps-{rank}.jsonl" if per_rank else "steps.jsonl")
        torchrun(
            nproc,
            [
                "-m",
                "worker.trainer",
                "--spec",
                str(spec_file(spec, d)),
                "--metrics-out",
                str(out),
                "--quiet",
            ],
        )
        return [
            r
            for f in sorted(d.glob("steps*.jsonl"))
            for r in map(json.loads, f.read_text().splitlines())
            if "step" in r
        ]
