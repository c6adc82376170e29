"""The agent's per-generation run directories (`{run_dir}/jobs/{job}/g{generation}`: the
spec, the restore list, each rank's log and step records) are kept for the newest few only,
so an agent that runs for months does not fill its disk (docs/control-plane.md, "Retention").
Checkpoints and the run record beside them (worker/trainer/run_record.py) live elsewhere and
are never touched here."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger("meshkeeper.agent")


def prune_run_dirs(jobs_dir: Path, keep: int, current: Path) -> list[Path]:
    """Delete all but the `keep` newest generation directories under `jobs_dir` (by
    modification time; `current` always stays), and the job directories left without one.
    Returns the generation directories deleted."""
    gens = sorted(jobs_dir.glob("*/g*"), key=lambda p: p.stat().st_mtime, reverse=True)
    old = [d for d in gens[keep:] if d != current]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
        if d.parent.exists() and not any(d.parent.glob("g*")):
            shutil.rmtree(d.parent, ignore_errors=True)
    if old:
        log.info("removed %d old run directories under %s", len(old), jobs_dir)
    return old
