"""`meshkeeper plan SPEC --workers N --devices-per-worker D --device NAME [--fabric tcp]
[--json] [--measure]` (docs/planner.md, "Command line and API").

Plans locally (the planner is torch-free): a table of the best layouts, or with `--json`
{"fabric": NAME, "given": PLAN or null, "plans": [every feasible PLAN, best first]}.
`--measure` then runs a few steps of the top candidates on the live pool (the controller at
--url) and ranks them by measured tokens/s: the model's first choice and the measured winner
are both printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import fields

from rich.table import Table

from cli import render
from services import api, planner
from services.client import Client
from services.spec import JobSpec, load_spec
from services.tokens import read_token

GiB = 2**30
TERMINAL = ("Succeeded", "Failed", "Cancelled")


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return n


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="rank the parallel layouts of a spec on a cluster")
    p.add_argument("spec")
    p.add_argument("--workers", type=positive, required=True, help="hosts")
    p.add_argument("--devices-per-worker", type=positive, default=1)
    p.add_argument("--device", default="cpu", choices=sorted(planner.PROFILES))
    p.add_argument(
        "--fabric",
        default="infiniband",
        choices=list(planner.FABRICS),
        help="the network between hosts: tcp for NCCL over Ethernet sockets (no RDMA)",
    )
    p.add_argument(
        "--memory-per-device-gib",
        type=float,
        help="override the profile's memory (cpu: default host RAM / devices)",
    )
    p.add_argument("--top", type=int, default=10, help="rows in the table")
    p.add_argument("--json", action="store_true", help="every feasible plan as JSON")
    p.add_argument(
        "--measure",
        type=int,
        nargs="?",
        const=3,
        metavar="K",
        help="run the top K (default 3) plans on the live pool and rank them by tokens/s",
    )
    p.add_argument("--measure-steps", type=int, default=6, help="steps per measured run")
    p.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    memory = int(args.memory_per_device_gib * GiB) if args.memory_per_device_gib else None
    where = planner.cluster(
        args.device, args.workers, args.devices_per_worker, memory, planner.FABRICS[args.fabric]
    )
    result = api.PlanResult.model_validate(planner.report(spec, where))
    if args.json and not args.measure:
        print(json.dumps(result.model_dump(mode="json")))
        return 0
    out = render.console()
    out.print(plans_table(result, args.top))
    if not result.plans:
        out.print("no layout fits; see `given` with --json for why")
        return 1
    if args.measure:
        with Client(args.url, read_token()) as c:
            return measure(c, spec, result.plans[: args.measure], args.measure_steps, out)
    return 0


def _layout(p: api.PlanDoc) -> str:
    sched = f" {p.pp_schedule}" if p.pp > 1 else ""
    sched += f"/v{p.virtual_stages}" if p.virtual_stages > 1 else ""
    ac = {True: " AC", "selective": " SAC"}.get(p.activation_checkpointing, "")
    return f"dp{p.dp} pp{p.pp} tp{p.tp} zero{p.zero} M{p.microbatches}{sched}{ac}"


def plans_table(result: api.PlanResult, top: int) -> Table:
    t = Table(title=f"{len(result.plans)} feasible layouts over {result.fabric}, best first")
    for col in ("#", "layout", "GiB/rank", "snapshots GiB/rank", "step s", "bubble", "why"):
        t.add_column(col)
    rows = [(str(i + 1), p) for i, p in enumerate(result.plans[:top])]
    if result.given is not None:
        rows.append(("spec", result.given))
    for label, p in rows:
        t.add_row(
            label,
            _layout(p),
            f"{p.memory_per_rank_bytes / GiB:.2f}",
            f"{p.snapshot_per_rank_bytes / GiB:.2f}",
            f"{p.step_time_s:.3g}",
            f"{p.bubble:.2f}",
            p.explanation,
        )
    return t


def measured_tokens_per_s(c: Client, spec: dict, steps: int) -> float:
    """Run `spec` for `steps` steps; the median tokens/s of its steps after the first."""
    job = c.submit(spec).id
    deadline = time.monotonic() + 600
    while (status := c.job(job)).phase not in TERMINAL:
        if time.monotonic() > deadline:
            c.cancel(job)
            raise TimeoutError(f"job {job} did not finish in 600 s")
        time.sleep(0.5)
    if status.phase != "Succeeded":
        raise RuntimeError(f"measuring job {job} ended {status.phase}")
    history = c.http.get(f"/v1/jobs/{job}/history").json()
    rates = [p["tokens_per_s"] for p in history["points"] if p["step"] > 1]
    return statistics.median(rates) if rates else float(status.tokens_per_s or 0)


def measure(c: Client, spec: JobSpec, plans: list[api.PlanDoc], steps: int, out) -> int:
    base = spec.model_dump(mode="json")
    rates = []
    for i, p in enumerate(plans):
        layout = planner.Layout(**{f.name: getattr(p, f.name) for f in fields(planner.Layout)})
        run = {
            **base,
            "name": f"{spec.name[:50]}-plan{i + 1}",
            "parallel": layout.parallel(spec.parallel).model_dump(mode="json"),
            "train": {**base["train"], "steps": steps, "warmup_steps": 0},
            "checkpoint": {**base["checkpoint"], "every_steps": 10**6},
            "fault_tolerance": {**base["fault_tolerance"], "spares": 0, "min_dp": 1},
        }
        rate = measured_tokens_per_s(c, run, steps)
        rates.append(rate)
        out.print(f"measured {i + 1}: {_layout(p)}: {rate:,.0f} tokens/s")
    best = max(range(len(plans)), key=rates.__getitem__)
    out.print(f"model's first choice: {_layout(plans[0])}: {rates[0]:,.0f} tokens/s")
    out.print(f"measured best: {_layout(plans[best])}: {rates[best]:,.0f} tokens/s")
    return 0
