"""Follow a job until it ends: its progress, each recovery as it completes, the summary.

A terminal gets a live progress bar (rich) with the recoveries printed above it; a pipe or a
CI log gets plain progress lines, one for a step at most (the first poll that shows it, with
that step's loss) and at most every 2 s."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from cli import render
from services import api
from services.client import Client

TERMINAL = ("Succeeded", "Failed", "Cancelled")
LOG_EVERY_S = 2.0


class LiveBar:
    def __init__(self, out: Console):
        self.progress = Progress(
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("{task.fields[info]}", markup=False),
            console=out,
        )
        self.task: TaskID | None = None  # added with the first status: its step count

    def __enter__(self) -> LiveBar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def show(self, j: api.JobStatus) -> None:
        if self.task is None:
            self.task = self.progress.add_task("", total=j.steps, info="")
        self.progress.update(
            self.task, completed=j.step, total=j.steps, info=render.progress_info(j)
        )


class LogLines:
    def __init__(self, out: Console):
        self.out, self.printed_step, self.printed_at = out, -1, 0.0
        self.phase: str | None = None

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, j: api.JobStatus) -> None:
        # Keyed on the step, not on the line: the ETA, the speed or the phase change between
        # polls of one step, and printing on any change printed step 12 twice. The job's step
        # never goes back (a recovery redoes steps below it), so no step returns either.
        if self.phase is not None and j.phase != self.phase and j.phase not in TERMINAL:
            self.out.print(f"{j.id}: {j.phase}")  # a line of its own, never a step's again
        self.phase = j.phase
        due = time.monotonic() - self.printed_at > LOG_EVERY_S or j.phase in TERMINAL
        if j.step > self.printed_step and due:
            self.out.print(render.progress_line(j))
            self.printed_step, self.printed_at = j.step, time.monotonic()


def watch(
    c: Client, job_id: str, interval: float, on_poll: Callable[[api.JobStatus], None] | None = None
) -> int:
    """Live progress until the job ends; exit 0 only if it succeeded. Recoveries are
    printed as they complete; `on_poll(job)` runs on every poll (the demo's fault)."""
    out = render.console()
    shown = 0
    with LiveBar(out) if out.is_terminal else LogLines(out) as view:
        while True:
            j = c.job(job_id)
            if on_poll:
                on_poll(j)
            done = [r for r in j.recoveries if r.completed_at]
            for rec in done[shown:]:
                out.print(render.recovery(rec))  # on a terminal: above the live bar
            shown = len(done)
            view.show(j)
            if j.phase in TERMINAL:
                break
            time.sleep(interval)
    out.print(render.summary(j))
    return 0 if j.phase == "Succeeded" else 1
