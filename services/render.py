"""Plain-text views of API documents for the CLI: tables, a job's detail, the progress line."""

from __future__ import annotations

import time

from services import api

def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def num(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def shape(s: api.Coordinate) -> str:
    return f"dp{s.dp}·pp{s.pp}·tp{s.tp}"


def jobs_table(jobs: list[api.JobSummary]) -> str:
    now = time.time()
    rows = [[j.id, j.phase, f"{j.step}/{j.steps}", num(j.loss), shape(j.mesh_shape),
             duration(now - j.submitted_at) if j.submitted_at else "-"] for j in jobs]
    return table(["JOB", "PHASE", "STEP", "LOSS", "MESH", "AGE"], rows) if rows else "no jobs"


def workers_table(workers: list[api.Worker]) -> str:
    rows = [[w.id, w.host or "-", w.address or "-", str(w.devices), w.state,
             w.job or "-", w.role or "-", f"{w.last_seen_s:.1f}s"] for w in workers]
    return (table(["WORKER", "HOST", "ADDRESS", "DEV", "STATE", "JOB", "ROLE", "SEEN"], rows)
            if rows else "no workers registered")


def job_detail(j: api.JobStatus) -> str:
    out = [f"job {j.id} ({j.name}): {j.phase}",
           f"  step {j.step}/{j.steps}  loss {num(j.loss)}  {num(j.tokens_per_s, ',.0f')} tokens/s"
           f"  ETA {duration(j.eta_s)}  generation {j.generation}  restarts {j.restarts}"]
    if j.last_checkpoint:
        c = j.last_checkpoint
        out.append(f"  last checkpoint: step {c.step} at {c.path}")
    out.append("  conditions:")
    out += [f"    {c.type:<11} {c.status:<5} {c.reason}: {c.message}" for c in j.conditions]
    m = j.mesh
    if m.ranks:
        out.append(f"  mesh {shape(m.shape)}, generation {m.generation}, rendezvous {m.rendezvous}:")
        out += mesh_grid(m)
        if m.spares:
            out.append(f"    spares: {', '.join(m.spares)}")
    return "\n".join(out)


def mesh_grid(m: api.Mesh) -> list[str]:
    """One block per DP replica: PP stages as rows, TP ranks as columns ('r3@w3:R')."""
    by = {(r.coord.dp, r.coord.pp, r.coord.tp): r for r in m.ranks}
    lines = []
    for d in range(m.shape.dp):
        lines.append(f"    dp={d}")
        for p in range(m.shape.pp):
            cells = [by.get((d, p, t)) for t in range(m.shape.tp)]
            lines.append(f"      pp={p}: " + "  ".join(
                f"r{r.rank}@{r.worker}:{r.state}" if r else "?" for r in cells))
    return lines


def progress_line(j: api.JobStatus, width: int = 24) -> str:
    frac = min(1.0, j.step / j.steps) if j.steps else 0.0
    bar = "#" * int(frac * width) + "." * (width - int(frac * width))
    reason = next((c.reason for c in j.conditions if c.type == "Running"), "")
    return (f"[{bar}] step {j.step}/{j.steps}  loss {num(j.loss)}  "
            f"{num(j.tokens_per_s, ',.0f')} tok/s  ETA {duration(j.eta_s)}  {j.phase}"
            + (f" ({reason})" if j.phase in ("Pending", "Running") and reason else ""))


def summary(j: api.JobStatus) -> str:
    took = (j.finished_at - j.started_at) if j.finished_at and j.started_at else None
    end = next((c for c in j.conditions if c.type in ("Succeeded", "Failed") and c.status == "True"), None)
    lines = [f"job {j.id}: {j.phase}" + (f" ({end.reason}: {end.message})" if end else ""),
             f"  steps {j.step}/{j.steps}, final loss {num(j.loss)}, {num(j.tokens_per_s, ',.0f')} "
             f"tokens/s, training time {duration(took)}, mesh {shape(j.mesh_shape)}, "
             f"generation {j.generation}, restarts {j.restarts}"]
    return "\n".join(lines)


def recovery(r: api.Recovery) -> str:
    """One line per recovery: what failed, what replaced it, and each phase's duration."""
    f = r.faults[0] if r.faults else None
    what = (f"{r.cause}: rank {f['rank']} (dp={f['coord']['dp']} pp={f['coord']['pp']} "
            f"tp={f['coord']['tp']}) on {f['worker']}" if f else r.cause)
    moved = ", ".join(f"{m['old']} -> {m['new']}" for m in r.replaced)
    action = f"{r.action}" + (f" ({moved})" if moved else "") + (
        f", mesh now dp{r.to_shape[0]} pp{r.to_shape[1]} tp{r.to_shape[2]}" if r.to_shape else "")
    line = f"recovery {r.n}: {what} -> {action}"
    if r.durations:
        d = r.durations
        line += (f"\n  resumed at step {r.resumed_step} ({r.steps_lost} steps redone); detect "
                 f"{d['detect_s']:.2f}s, decide {d['decide_s']:.2f}s, rendezvous {d['rendezvous_s']:.2f}s, "
                 f"restore {d['restore_s']:.2f}s, first step {d['first_step_s']:.2f}s = "
                 f"{d['total_s']:.2f}s from fault to training")
    return line
