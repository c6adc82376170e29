"""`meshkeeper`: the command line. Every failure is one line on stderr and a non-zero exit code.

    meshkeeper up --workers 8                  # local stack: redis-server, controller, agents
    meshkeeper submit examples/tiny-3d.yaml --watch
    meshkeeper status [JOB] | watch JOB | cancel JOB | workers | ready
    meshkeeper demo                            # up + a 3D job, a rank killed, the recovery
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from services import render
from services.client import DEFAULT_URL, ApiError, Client
from services.spec import SpecError, load_spec
from services.stack import LocalStack, StackConfig, StackError, wait_ready
from services.tokens import TokenError, read_token

TERMINAL = ("Succeeded", "Failed", "Cancelled")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class CliError(Exception):
    pass


def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, read_token())


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        lines = [f"meshkeeper: {args.spec} is not a valid job spec ({len(e.problems)} problem(s)):"]
        print("\n".join(lines + [f"  - {p}" for p in e.problems]), file=sys.stderr)
        return 2
    with _client(args) as c:
        job = c.submit(spec.model_dump(mode="json"))
        print(job.id)
        if args.watch:
            return _watch(c, job.id, args.interval)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(render.job_detail(c.job(args.job)) if args.job else render.jobs_table(c.jobs()))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return _watch(c, args.job, args.interval)


def _watch(c: Client, job_id: str, interval: float, on_poll=None) -> int:
    """Live progress until the job ends; exit 0 only if it succeeded. Recoveries are
    printed as they complete; `on_poll(job)` runs on every poll (the demo's fault)."""
    tty, last, last_print, shown = sys.stdout.isatty(), "", 0.0, 0
    while True:
        j = c.job(job_id)
        if on_poll:
            on_poll(j)
        done = [r for r in j.recoveries if r.completed_at]
        for rec in done[shown:]:
            print(("\n" if tty else "") + render.recovery(rec), flush=True)
        shown = len(done)
        line = render.progress_line(j)
        if tty:
            print("\r\033[K" + line, end="", flush=True)
        elif line != last and (time.monotonic() - last_print > 2 or j.phase in TERMINAL):
            print(line, flush=True)
            last_print = time.monotonic()
        last = line
        if j.phase in TERMINAL:
            print(("\n" if tty else "") + render.summary(j))
            return 0 if j.phase == "Succeeded" else 1
        time.sleep(interval)


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        r = c.cancel(args.job)
        print(f"cancel requested for {r.id} (was {r.phase})")
        if args.wait:
            deadline = time.monotonic() + args.wait
            while time.monotonic() < deadline:
                j = c.job(args.job)
                if j.phase in TERMINAL:
                    print(f"{j.id}: {j.phase}")
                    return 0
                time.sleep(0.3)
            raise CliError(f"{args.job} did not stop within {args.wait:.0f}s")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(render.workers_table(c.workers()))
    return 0


def cmd_ready(args: argparse.Namespace) -> int:
    """Wait until the controller is ready and at least N workers are alive (for scripts)."""
    if wait_ready(args.url, args.workers, args.timeout, token=read_token()):
        print(f"ready: {args.url}")
        return 0
    raise CliError(f"the controller at {args.url} was not ready with {args.workers} workers "
                   f"within {args.timeout:.0f}s")


def _stack(args: argparse.Namespace) -> LocalStack:
    if args.workers < 1:
        raise CliError("--workers must be at least 1")
    return LocalStack(StackConfig(workers=args.workers, port=args.port, run_dir=args.run_dir.resolve(),
                                  redis_url=os.environ.get("REDIS_URL") or None, warm=args.warm))


def _stop_on_signals() -> None:
    def raise_interrupt(signum, _frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, raise_interrupt)


def cmd_up(args: argparse.Namespace) -> int:
    stack = _stack(args)
    _stop_on_signals()
    try:
        stack.start()
        sec = stack.secrets
        print(f"meshkeeper up: controller {stack.url}, {args.workers} workers; logs in {stack.logs}; "
              f"secrets (tokens, Redis passwords; mode 0600) in {sec.dir}", flush=True)
        print(f"  export MESHKEEPER_URL={stack.url} MESHKEEPER_TOKEN_FILE={sec.api_token_file}\n"
              f"  meshkeeper submit SPEC.yaml --watch   (Ctrl-C here stops everything)\n"
              f"  more agents: python -m worker --controller {stack.url} --join-token-file {sec.join_token_file}",
              flush=True)
        if stack.redis_argv:  # our own redis-server
            print(f"  redis-cli: REDISCLI_AUTH=$(cat {sec.dir / 'redis-admin-password'}) redis-cli "
                  f"--user admin -p {stack.redis_argv[2]}", flush=True)
        while True:
            stack.check()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nmeshkeeper up: stopping", file=sys.stderr)
        return 0
    finally:
        stack.stop()


class RankKiller:
    """The demo's fault: SIGKILL one rank's trainer once the job passes a step."""

    def __init__(self, rank: int | None, at_step: int):
        self.rank, self.at_step, self.done = rank, at_step, False

    def __call__(self, j) -> None:
        if self.done or j.phase != "Running" or j.step < self.at_step:
            return
        ranks = j.mesh.ranks
        victim = ranks[self.rank if self.rank is not None else len(ranks) // 2 + 1]
        if victim.pid is None:
            return
        c = victim.coord
        print(f"\n>>> demo: SIGKILL rank {victim.rank} (dp={c.dp} pp={c.pp} tp={c.tp}) on worker "
              f"{victim.worker}, pid {victim.pid}, at step {j.step}", flush=True)
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it just ended: try the next poll
        self.done = True


def cmd_demo(args: argparse.Namespace) -> int:
    """The whole path on this machine: up, submit a 3D job, kill a rank mid-run, watch the
    recovery, summary, stop."""
    stack = _stack(args)
    _stop_on_signals()
    try:
        spec = load_spec(args.spec)
        print(f"meshkeeper demo: starting redis, a controller and {args.workers} workers "
              f"(logs in {stack.logs})", flush=True)
        stack.start()
        with Client(stack.url, stack.secrets.admin_token) as c:
            job = c.submit(spec.model_dump(mode="json"))
            at = args.kill_at_step or max(spec.checkpoint.every_steps + 2, int(spec.train.steps * 0.4))
            print(f"submitted {args.spec} as {job.id}; a rank will be killed at step {at}", flush=True)
            code = _watch(c, job.id, args.interval, None if args.no_kill else RankKiller(args.kill_rank, at))
            final = c.job(job.id)
            print(render.job_detail(final))
            for rec in final.recoveries:
                print(render.recovery(rec))
            return code
    except KeyboardInterrupt:
        return 130
    finally:
        stack.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshkeeper", description="elastic 3D-parallel training")
    ap.add_argument("--url", default=os.environ.get("MESHKEEPER_URL", DEFAULT_URL),
                    help=f"controller URL (env MESHKEEPER_URL, default {DEFAULT_URL}); the API "
                         "token comes from env MESHKEEPER_TOKEN or the file MESHKEEPER_TOKEN_FILE names")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def stack_opts(p: argparse.ArgumentParser, workers: int, run_dir: str) -> None:
        p.add_argument("--workers", type=int, default=workers)
        p.add_argument("--port", type=int, default=8765, help="controller port")
        p.add_argument("--run-dir", type=Path, default=Path(run_dir), help="logs and trainer files")
        p.add_argument("--warm", type=int, default=1, help="warm trainers per worker")

    p = sub.add_parser("up", help="run redis-server, the controller and N agents locally")
    stack_opts(p, 4, ".meshkeeper/up")
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("demo", help="up + a small 3D job, a rank killed mid-run, the recovery")
    stack_opts(p, 9, ".meshkeeper/demo")
    p.add_argument("--spec", default=str(EXAMPLES / "demo-3d.yaml"))
    p.add_argument("--kill-at-step", type=int, help="default: 40%% of the steps, after a checkpoint")
    p.add_argument("--kill-rank", type=int, help="default: the rank after the middle one")
    p.add_argument("--no-kill", action="store_true", help="no fault: just train")
    p.add_argument("--interval", type=float, default=0.5)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("submit", help="submit a job spec (YAML/JSON)")
    p.add_argument("spec")
    p.add_argument("--watch", action="store_true", help="then watch it to the end")
    p.add_argument("--interval", type=float, default=0.5)
    p.set_defaults(fn=cmd_submit)
    p = sub.add_parser("status", help="all jobs, or one job in detail")
    p.add_argument("job", nargs="?")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("watch", help="live progress of a job until it ends")
    p.add_argument("job")
    p.add_argument("--interval", type=float, default=0.5)
    p.set_defaults(fn=cmd_watch)
    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job")
    p.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for it to stop")
    p.set_defaults(fn=cmd_cancel)
    p = sub.add_parser("workers", help="the worker pool")
    p.set_defaults(fn=cmd_workers)
    p = sub.add_parser("ready", help="wait for the controller and N workers (for scripts)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60)
    p.set_defaults(fn=cmd_ready)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ApiError as e:
        print(f"meshkeeper: {e}", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p.field}: {p.message}", file=sys.stderr)
        return 1
    except (CliError, StackError, SpecError, TokenError) as e:
        print(f"meshkeeper: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
