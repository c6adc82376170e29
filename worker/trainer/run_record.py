"""A job's run record: TensorBoard event files of its training curves, written by global rank
0 (the caller decides) to one directory per job across generations (the agent passes
`<checkpoint root>/<job>/<spec name>/tensorboard`, on the storage every rank's host shares, so
the record stays whole when a recovery moves rank 0 to another host; docs/observability.md,
"Run record").

A recovered generation appends to the same directory: it opens its writer with
`purge_step = start_step + 1`, so TensorBoard drops whatever a dead generation wrote after the
restore point (steps it redoes) and each step reads exactly once. Steps up to start_step were
committed before the restore and stay.

Nothing here may stop training: the first failure to write (a full disk, a missing package) is
one warning line on stderr, and the record is off for the rest of the generation.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.records import perplexity

if TYPE_CHECKING:
    from worker.trainer.step import StepResult

# Flushed every few seconds, not torch's default 120 (where the file system buffers: without
# TensorFlow, tensorboard appends each event to the file as it comes): a trainer killed by a
# fault loses its unflushed events, and those up to the restore point are never written again.
FLUSH_S = 5


class RunRecord:
    def __init__(self, logdir: Path, start_step: int):
        """`start_step`: steps completed before this generation's first (0 for a fresh job)."""
        self.writer = None
        try:  # imported here: without tensorboard the record is off, and training goes on
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(logdir), purge_step=start_step + 1, flush_secs=FLUSH_S)
        except Exception as e:  # ImportError without tensorboard, OSError on the directory
            self._off(e)

    def step(self, r: StepResult, eval_loss: float | None, mfu: float | None) -> None:
        """One optimizer step's scalars at its step number; the eval's when one ran after it."""
        scalars = {
            "train/loss": r.loss,
            "train/lr": r.lr,
            "train/grad_norm": r.grad_norm,
            "train/tokens_per_s": r.tokens / r.step_s,
            "train/step_s": r.step_s,
            "train/mfu": mfu,
            "eval/loss": eval_loss,
            "eval/perplexity": perplexity(eval_loss) if eval_loss is not None else None,
        }
        for tag, value in scalars.items():
            if value is not None:
                self._call("add_scalar", tag, value, r.step)

    def note(self, step: int, text: str) -> None:
        """A line of text at `step` ("resumed at step 120 from memory (generation 2)")."""
        self._call("add_text", "notes", text, step)

    def close(self) -> None:
        self._call("close")
        self.writer = None

    def _call(self, method: str, *args: object) -> None:
        if self.writer is None:
            return
        try:
            getattr(self.writer, method)(*args)
        except Exception as e:  # the writer thread's OSError surfaces on the next call
            self._off(e)

    def _off(self, e: Exception) -> None:
        # one write: tensorboard's writer thread may be printing its traceback meanwhile
        sys.stderr.write(f"meshkeeper: run record off: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        writer, self.writer = self.writer, None
        if writer is not None:
            try:  # stops its thread; the events it still holds are lost either way
                writer.close()
            except Exception:
                pass
