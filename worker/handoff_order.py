"""The order an agent hands a kept trainer: the next generation to run in its own process
(worker/trainer/handoff.py, issue 48). Written by the agent, read by the trainer, one file
per rank slot (`{run_dir}/jobs/{job}/rank{r}.handoff.json`), always whole (renamed into
place), so a reader never sees half of one."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Order:
    """The next generation for a kept trainer: its argv, environment and log."""

    generation: int
    argv: list[str]
    env: dict[str, str]
    log: str

    @classmethod
    def read(cls, path: Path) -> Order | None:
        """The order at `path`; None when there is none (or not a whole one: never written
        by this agent)."""
        try:
            raw = json.loads(path.read_text())
            return cls(int(raw["generation"]), list(raw["argv"]), dict(raw["env"]), str(raw["log"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, path: Path) -> None:
        staged = path.with_suffix(".staged")
        staged.write_text(json.dumps(asdict(self)))
        staged.replace(path)
