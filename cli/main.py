"""`meshkeeper`: the command line. Every failure is one line on stderr and a non-zero exit code.

meshkeeper up --workers 8                  # local stack: redis-server, controller, agents
meshkeeper submit examples/tiny-3d.yaml --watch
meshkeeper status [JOB] | watch JOB | cancel JOB | suspend JOB | resume JOB | workers | ready
meshkeeper demo                            # up + a 3D job, a rank killed, the recovery
meshkeeper plan SPEC --workers 32 --devices-per-worker 8 --device a100-80gb [--json]
meshkeeper data prepare INPUT... --tokenizer T --out DIR   # text to token shards; data verify DIR
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from cli import data, export, logs, plan, render
from cli.demo import run_demo
from cli.local_stack import LocalStack, StackConfig, StackError, wait_ready
from cli.stop_and_resume import resume_listed, suspend_open_jobs
from cli.watch import TERMINAL, watch
from services.client import DEFAULT_URL, ApiError, Client
from services.spec import SpecError, load_spec
from services.tokens import TokenError, read_token

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
            return watch(c, job.id, args.interval)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        view = render.job_detail(c.job(args.job)) if args.job else render.jobs_table(c.jobs())
        render.console().print(view)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return watch(c, args.job, args.interval)


def cmd_suspend(args: argparse.Namespace) -> int:
    with _client(args) as c:
        r = c.suspend(args.job) if args.suspend else c.resume(args.job)
        done = (
            "suspend requested: it commits a step and frees its workers"
            if r.suspend_requested
            else "resume requested: it queues and restores its commit"
        )
        print(f"{done} ({r.id}, was {r.phase})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        r = c.cancel(args.job)
        print(f"cancel requested for {r.id} (was {r.phase})")
        if args.wait:
            until_stopped = Retrying(
                stop=stop_after_delay(args.wait),
                wait=wait_fixed(0.3),
                retry=retry_if_result(lambda j: j.phase not in TERMINAL),
                retry_error_callback=lambda _: None,
            )
            j = until_stopped(c.job, args.job)
            if j is None:
                raise CliError(f"{args.job} did not stop within {args.wait:.0f}s")
            print(f"{j.id}: {j.phase}")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with _client(args) as c:
        render.console().print(render.workers_table(c.workers()))
    return 0


def cmd_ready(args: argparse.Namespace) -> int:
    """Wait until the controller is ready and at least N workers are alive (for scripts)."""
    if wait_ready(args.url, args.workers, args.timeout, token=read_token()):
        print(f"ready: {args.url}")
        return 0
    raise CliError(
        f"the controller at {args.url} was not ready with {args.workers} workers "
        f"within {args.timeout:.0f}s"
    )


def _stack(args: argparse.Namespace) -> LocalStack:
    if args.workers < 1:
        raise CliError("--workers must be at least 1")
    return LocalStack(
        StackConfig(
            workers=args.workers,
            port=args.port,
            run_dir=args.run_dir.resolve(),
            redis_url=os.environ.get("REDIS_URL") or None,
            warm=args.warm,
            allow_chaos=args.allow_chaos,
            priority_classes=args.priority_classes,
        )
    )


def _stop_on_signals() -> None:
    def raise_interrupt(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, raise_interrupt)


def cmd_up(args: argparse.Namespace) -> int:
    stack = _stack(args)
    _stop_on_signals()
    started = False
    try:
        stack.start()
        started = True
        sec = stack.secrets
        with Client(stack.url, sec.admin_token) as c:
            resume_listed(c, stack.cfg.run_dir, stack.say)
        print(
            f"meshkeeper up: controller {stack.url}, {args.workers} workers; logs in {stack.logs}; "
            f"secrets (tokens, Redis passwords; mode 0600) in {sec.dir}",
            flush=True,
        )
        print(
            f"  export MESHKEEPER_URL={stack.url} MESHKEEPER_TOKEN_FILE={sec.api_token_file}\n"
            f"  meshkeeper submit SPEC.yaml --watch   (Ctrl-C suspends the jobs, then stops)\n"
            f"  more agents: python -m worker --controller {stack.url} "
            f"--join-token-file {sec.join_token_file}",
            flush=True,
        )
        if stack.redis_argv:  # our own redis-server
            print(
                f"  redis-cli: REDISCLI_AUTH=$(cat {sec.dir / 'redis-admin-password'}) redis-cli "
                f"--user admin -p {stack.redis_argv[2]}",
                flush=True,
            )
        while True:
            stack.check()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nmeshkeeper up: stopping", file=sys.stderr)
        if started:
            try:
                with Client(stack.url, stack.secrets.admin_token) as c:
                    suspend_open_jobs(c, stack.cfg.run_dir, stack.say)
            except KeyboardInterrupt:
                print("meshkeeper up: stopping at once", file=sys.stderr)
        return 0
    finally:
        stack.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    world = spec.parallel.world_size
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        raise CliError(
            f"--kill-rank {args.kill_rank}: {args.spec} runs ranks 0..{world - 1}; name one"
        )
    stack = _stack(args)
    _stop_on_signals()
    try:
        return run_demo(
            stack,
            spec,
            args.spec,
            args.interval,
            args.kill_at_step,
            args.kill_rank,
            kill=not args.no_kill,
        )
    except KeyboardInterrupt:
        return 130
    finally:
        stack.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshkeeper", description="elastic 3D-parallel training")
    ap.add_argument(
        "--url",
        default=os.environ.get("MESHKEEPER_URL", DEFAULT_URL),
        help=f"controller URL (env MESHKEEPER_URL, default {DEFAULT_URL}); the API "
        "token comes from env MESHKEEPER_TOKEN or the file MESHKEEPER_TOKEN_FILE names",
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def stack_opts(p: argparse.ArgumentParser, workers: int, run_dir: str) -> None:
        p.add_argument("--workers", type=int, default=workers)
        p.add_argument("--port", type=int, default=8765, help="controller port")
        p.add_argument("--run-dir", type=Path, default=Path(run_dir), help="logs and trainer files")
        p.add_argument(
            "--warm",
            type=int,
            default=1,
            help="0: each worker starts its trainers cold; above 0: forks them from a "
            "trainer zygote that imported torch once",
        )

    p = sub.add_parser("up", help="run redis-server, the controller and N agents locally")
    stack_opts(p, 4, ".meshkeeper/up")
    p.add_argument(
        "--allow-chaos",
        action="store_true",
        help="the controller accepts specs with chaos (fault injection) from the admin token",
    )
    p.add_argument(
        "--priority-classes",
        type=lambda s: Path(s).resolve(),
        help="YAML list of {name, value, preempts} for the controller (default: low 0, "
        "default 100, high 1000 preempts)",
    )
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("demo", help="up + a small 3D job, a rank killed mid-run, the recovery")
    stack_opts(p, 9, ".meshkeeper/demo")
    p.add_argument("--spec", default=str(EXAMPLES / "demo-3d.yaml"))
    p.add_argument(
        "--kill-at-step", type=int, help="default: 40%% of the steps, after a checkpoint"
    )
    p.add_argument("--kill-rank", type=int, help="default: the rank after the middle one")
    p.add_argument("--no-kill", action="store_true", help="no fault: just train")
    p.add_argument("--interval", type=float, default=0.5)
    # the demo injects nothing and runs under the built-in priority classes
    p.set_defaults(fn=cmd_demo, allow_chaos=False, priority_classes=None)
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
    p.add_argument(
        "--wait", type=float, default=0, help="wait up to this many seconds for it to stop"
    )
    p.set_defaults(fn=cmd_cancel)
    p = sub.add_parser("suspend", help="stop a job at a committed step and free its workers")
    p.add_argument("job")
    p.set_defaults(fn=cmd_suspend, suspend=True)
    p = sub.add_parser("resume", help="queue a suspended job again; it restores its commit")
    p.add_argument("job")
    p.set_defaults(fn=cmd_suspend, suspend=False)
    p = sub.add_parser("workers", help="the worker pool")
    p.set_defaults(fn=cmd_workers)
    plan.add_parser(sub)
    logs.add_parser(sub)
    export.add_parser(sub)
    data.add_parser(sub)
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
