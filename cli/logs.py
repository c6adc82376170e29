"""`meshkeeper logs JOB [--rank R] [--tail N] [--follow]`: what a job's trainers printed, from
the job's log stream (each agent echoes its ranks' output there; docs/architecture.md,
"Agent"), with the viewer role. Each line is prefixed with its rank and generation."""

from __future__ import annotations

import argparse
import sys
import time

from cli.watch import TERMINAL
from services.client import Client
from services.tokens import read_token

PAGE = 1000


def show(lines, out=sys.stdout) -> str | None:
    """Print `lines`; the id of the last, to read on after it."""
    for ln in lines:
        out.write(f"[rank {ln.rank} g{ln.generation}] {ln.line}\n")
    out.flush()
    return lines[-1].id if lines else None


def cmd_logs(args: argparse.Namespace) -> int:
    with Client(args.url, read_token()) as c:
        if args.tail:
            last = show(c.logs(args.job, limit=args.tail, rank=args.rank, newest=True)) or "-"
        else:
            last = "-"
            while page := c.logs(args.job, after=last, limit=PAGE, rank=args.rank):
                last = show(page)
        while args.follow:
            ended = c.job(args.job).phase in TERMINAL  # read before the lines: none is missed
            while page := c.logs(args.job, after=last, limit=PAGE, rank=args.rank):
                last = show(page)
            if ended:
                break
            time.sleep(args.interval)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="what a job's trainers printed")
    p.add_argument("job")
    p.add_argument("--rank", type=int, help="only this rank's lines")
    p.add_argument("--tail", type=int, metavar="N", help="only the newest N lines")
    p.add_argument("--follow", "-f", action="store_true", help="then follow until the job ends")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    p.set_defaults(fn=cmd_logs)
