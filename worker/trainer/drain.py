"""Stopping at a step boundary on request, to suspend the job (docs/architecture.md,
"Suspend and resume").

The controller picks the step every rank stops after (a few steps past the furthest one
reported, so every rank hears of it in time) and its agents write it to each trainer's
drain file. A trainer reads the file after every step: at that step it checkpoints, waits
for the commit and exits with `EXIT_SUSPENDED`. Every rank stops at the same step, so the
checkpoint is one collective like any other; no collective is added to a step. A rank that
hears of the step only after it passed it (its agent was late by more than the margin) keeps
training while the others save; their save fails, and the controller handles that as a
fault (or, past `preemption.grace_s`, stops the generation): the job then resumes from its
previous commit.
"""

from __future__ import annotations

from pathlib import Path


class Drain:
    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.step: int | None = None

    def due(self, step: int) -> bool:
        """Whether this trainer stops after `step` (a stat per step until the file exists)."""
        if self.path is None:
            return False
        if self.step is None:
            try:  # written whole by a rename (worker/agent/agent.py `_drain`)
                self.step = int(self.path.read_text())
            except (FileNotFoundError, ValueError):
                return False
        return step == self.step
