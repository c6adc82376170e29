"""The job every checkpoint test trains: tiny, seeded, with its checkpoint settings."""

from __future__ import annotations

from pathlib import Path

from worker.ckpt_store import CheckpointStore

JOB = "ckpt"


def spec(steps: int, every: int, mode: str = "async", **parallel) -> dict:
    return {
        "name": JOB,
        "model": {"preset": "tiny"},
        "data": {"seed": 11},
        "parallel": parallel,
        "train": {"steps": steps, "global_batch": 8, "lr": 1e-3, "warmup_steps": 3},
        "checkpoint": {"every_steps": every, "keep": 10, "mode": mode},
    }


def root_args(root: Path) -> list[str]:
    return ["--checkpoint-root", str(root)]


def committed_steps(root: Path) -> list[int]:
    """Steps the standalone pointer (committed.json) names."""
    return sorted(p.step for p in CheckpointStore(root, JOB).history())
