"""Views of the API's documents for the CLI (rich): tables, a job's detail, progress, recoveries.

On a terminal they get colour; anywhere else (a pipe, a CI log) the same text with no control
codes, each line as long as it is (never wrapped or cut to 80 columns), so scripts and tests can
read it. Cell text is never taken as rich markup: ids, paths and messages may hold brackets.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from services import api

PHASE_STYLE = {
    "Pending": "yellow",
    "Running": "cyan",
    "Suspended": "blue",
    "Succeeded": "green",
    "Failed": "bold red",
    "Cancelled": "magenta",
}
NOT_A_TTY_WIDTH = 100_000  # lines in a pipe or a log: as long as they are


def console(file: IO[str] | None = None) -> Console:
    file = file or sys.stdout
    tty = file.isatty()
    return Console(
        file=file,
        width=None if tty else NOT_A_TTY_WIDTH,
        no_color=not tty,
        markup=False,
        emoji=False,
        highlight=False,
    )


def table(headers: list[str], rows: list[list[str | Text]]) -> Table:
    """Columns two spaces apart, no borders: as plain to read in a log as on a terminal."""
    t = Table(*headers, box=None, pad_edge=False, header_style="bold", show_edge=False)
    for r in rows:
        t.add_row(*(c if isinstance(c, Text) else Text(c) for c in r))
    return t


def phase(p: str) -> Text:
    return Text(p, style=PHASE_STYLE.get(p, ""))


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def num(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def shape(s: api.Coordinate) -> str:
    # with experts split, ep is carved out of dp: dp4·ep2 is two groups of two replicas
    return f"dp{s.dp}·pp{s.pp}·tp{s.tp}" + (f"·ep{s.ep}" if s.ep else "")


def running_mesh(j: api.JobSummary) -> str:
    """The mesh the job runs now, and the spec's beside it while they differ."""
    return shape(j.mesh_shape) + (f" (of {shape(j.target_shape)})" if j.target_shape else "")


def jobs_table(jobs: list[api.JobSummary]) -> RenderableType:
    now = time.time()
    rows = [
        [
            j.id,
            phase(j.phase),
            f"{j.step}/{j.steps}",
            num(j.loss),
            running_mesh(j),
            duration(now - j.submitted_at) if j.submitted_at else "-",
        ]
        for j in jobs
    ]
    return table(["JOB", "PHASE", "STEP", "LOSS", "MESH", "AGE"], rows) if rows else "no jobs"


def workers_table(workers: list[api.Worker]) -> RenderableType:
    rows = [
        [
            w.id,
            w.host or "-",
            w.address or "-",
            str(w.devices),
            w.state,
            w.job or "-",
            w.role or "-",
            f"{w.last_seen_s:.1f}s",
        ]
        for w in workers
    ]
    return (
        table(["WORKER", "HOST", "ADDRESS", "DEV", "STATE", "JOB", "ROLE", "SEEN"], rows)
        if rows
        else "no workers registered"
    )


def job_detail(j: api.JobStatus) -> Group:
    head = Text.assemble(f"job {j.id} ({j.name}): ", phase(j.phase))
    out: list[RenderableType] = [
        head,
        Text(
            f"  step {j.step}/{j.steps}  loss {num(j.loss)}  {num(j.tokens_per_s, ',.0f')} "
            f"tokens/s  ETA {duration(j.eta_s)}  generation {j.generation}  "
            f"restarts {j.restarts}  mesh {running_mesh(j)}"
        ),
    ]
    if extra := validation(j):
        out.append(Text(f"  {extra}"))
    if j.goodput and j.goodput.wall_s > 0:
        out.append(Text.assemble("  ", goodput(j.goodput)))
    if j.last_checkpoint:
        c = j.last_checkpoint
        out.append(Text(f"  last checkpoint: step {c.step} at {c.path}"))
    if j.export:
        e = j.export
        if e.error:
            out.append(Text(f"  export to {e.path} FAILED: {e.error}", style="red"))
        else:
            size = f", {e.bytes / 1e9:.2f} GB" if e.bytes is not None else ""
            out.append(Text(f"  exported (Hugging Face): step {e.step} to {e.path}{size}"))
    if j.straggler:
        s = j.straggler
        out.append(
            Text(
                f"  straggler: rank {s.rank} on {s.worker} (generation {s.generation}), "
                "reported, not replaced",
                style="yellow",
            )
        )
    out.append(
        _indent(
            table(
                ["CONDITION", "STATUS", "REASON", "MESSAGE"],
                [[c.type, c.status, c.reason, c.message] for c in j.conditions],
            )
        )
    )
    m = j.mesh
    if m.ranks:
        out.append(
            Text(f"  mesh {shape(m.shape)}, generation {m.generation}, rendezvous {m.rendezvous}:")
        )
        out.append(_indent(mesh_table(m)))
        if m.spares:
            out.append(Text(f"  spares: {', '.join(m.spares)}"))
    return Group(*out)


# each part of the goodput ledger as the status line names and colours it
GOODPUT_STYLE = {
    "productive": "green",
    "redone": "yellow",
    "recovery": "red",
    "checkpoint": "blue",
    "snapshot": "blue",
    "eval": "blue",
    "waiting": "dim",
    "suspended": "magenta",
}


def goodput(g: api.Goodput) -> Text:
    """One line: 'goodput: ettr 0.91  productive 82%  recovery 2%  waiting 16%  of 1:02:13',
    each part's share of the wall time (the parts with none left out)."""
    line = Text(f"goodput: ettr {num(g.ettr, '.2f')} ")
    for part, seconds in g.parts.model_dump().items():
        name, share = part.removesuffix("_s"), seconds / g.wall_s
        if seconds > 0:
            pct = f"{share:.0%}" if share >= 0.005 else "<1%"
            line.append(f" {name} {pct}", style=GOODPUT_STYLE[name])
    return line.append(f"  of {duration(g.wall_s)}")


def _indent(t: Table) -> Padding:
    return Padding(t, (0, 0, 0, 2), expand=False)


def mesh_table(m: api.Mesh) -> Table:
    """One row per (DP replica, PP stage), one column per TP rank: 'r3@w3:running'. A replica
    is named by its dp index in the submitted layout (`dp_labels`), as the mesh page names it:
    after a shrink the survivor of dp 1 is still "1", though it is replica 0 of the world."""
    by = {(r.coord.dp, r.coord.pp, r.coord.tp): r for r in m.ranks}
    rows = []
    for d in range(m.shape.dp):
        label = m.dp_labels[d] if d < len(m.dp_labels) else d
        for p in range(m.shape.pp):
            cells = [by.get((d, p, t)) for t in range(m.shape.tp)]
            dp = f"{label} (ep {d % m.shape.ep})" if m.shape.ep else str(label)
            rows.append(
                [dp, str(p), *(f"r{r.rank}@{r.worker}:{r.state}" if r else "?" for r in cells)]
            )
    return table(["DP", "PP", *(f"TP{t}" for t in range(m.shape.tp))], rows)


def _reason(j: api.JobStatus) -> str:
    reason = next((c.reason for c in j.conditions if c.type == "Running"), "")
    return f" ({reason})" if j.phase in ("Pending", "Running") and reason else ""


def validation(j: api.JobStatus) -> str:
    """The latest eval and the epoch, those the job has: 'eval loss 3.1000 (perplexity 22.20)
    at step 40  epoch 2'; empty before either."""
    parts = []
    if j.eval_loss is not None:
        parts.append(
            f"eval loss {num(j.eval_loss)} (perplexity {num(j.eval_perplexity, ',.2f')}) "
            f"at step {j.eval_step}"
        )
    if j.epoch is not None:
        parts.append(f"epoch {j.epoch}")
    return "  ".join(parts)


def progress_info(j: api.JobStatus) -> str:
    """Everything about a job's progress but the bar and the step."""
    extra = validation(j)
    return (
        f"loss {num(j.loss)}  {extra + '  ' if extra else ''}"
        f"{num(j.tokens_per_s, ',.0f')} tok/s  ETA {duration(j.eta_s)}  {j.phase}{_reason(j)}"
    )


def progress_line(j: api.JobStatus) -> str:
    """One line of progress for a log: what a terminal sees as a live bar."""
    return f"step {j.step}/{j.steps}  {progress_info(j)}"


def summary(j: api.JobStatus) -> Text:
    took = (j.finished_at - j.started_at) if j.finished_at and j.started_at else None
    ends = ("Succeeded", "Failed", "Cancelled")
    end = next((c for c in j.conditions if c.type in ends and c.status == "True"), None)
    extra = validation(j)
    return Text.assemble(
        f"job {j.id}: ",
        phase(j.phase),
        f" ({end.reason}: {end.message})" if end else "",
        f"\n  steps {j.step}/{j.steps}, final loss {num(j.loss)}, "
        f"{num(j.tokens_per_s, ',.0f')} tokens/s, training time {duration(took)}, "
        f"mesh {running_mesh(j)}, generation {j.generation}, restarts {j.restarts}",
        f"\n  {extra}" if extra else "",
    )


def recovery(r: api.Recovery) -> Text:
    """What failed, what replaced it, and each phase's duration."""
    f = r.faults[0] if r.faults else None
    what = (
        f"{r.cause}: rank {f.rank} (dp={f.coord['dp']} pp={f.coord['pp']} "
        f"tp={f.coord['tp']}) on {f.worker}"
        if f
        else r.cause
    )
    moved = ", ".join(f"{m['old']} -> {m['new']}" for m in r.replaced)
    action = (
        f"{r.action}"
        + (f" ({moved})" if moved else "")
        + (
            f", mesh now dp{r.to_shape[0]} pp{r.to_shape[1]} tp{r.to_shape[2]}"
            if r.to_shape
            else ""
        )
    )
    line = f"recovery {r.n}: {what} -> {action}"
    if r.durations:
        d = r.durations
        line += (
            f"\n  {r.redone_summary()}"
            + (f"; restored from {r.restored_summary()}" if r.restored_from else "")
            + "; "
            + ", ".join(
                f"{k[:-2].replace('_', ' ')} {v:.2f}s" for k, v in d.items() if k != "total_s"
            )
            + (f" = {d['total_s']:.2f}s from fault to training" if "total_s" in d else "")
        )
    return Text(line, style="bold yellow")
