"""The rank's metrics file: one JSON line per step (services.records.StepRecord) and one per
milestone ({"event": ...}), which the agent tails (docs/architecture.md, "Records")."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from services.records import StepRecord
from worker.trainer.step import StepResult


class MetricsFile:
    """`template` with '{rank}' gives every rank its own file; without it only rank 0 writes.
    No template: nothing is written."""

    def __init__(self, template: str | None, rank: int):
        self.rank = rank
        self.file = None
        self.lock = threading.Lock()
        if template and ("{rank}" in template or rank == 0):
            path = Path(template.replace("{rank}", str(rank)))
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        """One line: a milestone or checkpoint event is {"event": name, ...}. From any thread
        (the checkpoint's hashing, the I/O ticker): one line at a time."""
        if self.file:
            line = json.dumps(record) + "\n"
            with self.lock:
                self.file.write(line)

    def step(self, r: StepResult, eval_loss: float | None = None, eval_s: float | None = None):
        rec = StepRecord(
            step=r.step,
            loss=r.loss,
            tokens_per_s=r.tokens / r.step_s,
            step_s=r.step_s,
            compute_s=r.compute_s,
            wait_s=r.wait_s,
            probe_s=r.probe_s,
            lr=r.lr,
            grad_norm=r.grad_norm,
            peak_mem_bytes=r.peak_mem_bytes,
            rank=self.rank,
            time=time.time(),
            experts=r.experts,
            epoch=r.epoch,
            eval_loss=eval_loss,
            eval_s=eval_s,
        )
        self.write(rec.model_dump())

    def close(self) -> None:
        if self.file:
            self.file.close()
