"""`REDIS_URL=redis://controller:PASSWORD@... python -m controller --host 127.0.0.1 --port 8765`"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

from controller import priorities as priority_classes
from controller.admission import AdmissionConfig, Quotas
from controller.auth import Auth, refuse_without_admin
from controller.pool_limits import PoolLimits
from controller.priorities import PriorityClasses
from controller.retention import RetentionConfig
from controller.scheduler import SchedulerConfig
from controller.service import Controller, ControllerConfig
from controller.slow_clients import request_deadline
from services.redis_url import holds_secret
from services.tokens import TokenError


def _port_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use LOW-HIGH, like 20000-32000") from None
    if not 1024 <= lo < hi <= 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1024 <= LOW < HIGH <= 65536")
    return lo, hi


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds above 0, like 86400")
    return value


def _ranks(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a quota is a number of ranks, 0 or more")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a count, 0 or more")
    return int(text)


def _quota(text: str) -> tuple[str, int]:
    owner, sep, n = text.partition("=")
    if not (sep and owner):
        raise argparse.ArgumentTypeError(f"{text!r}: use OWNER=RANKS, like alice=16")
    return owner, _ranks(n)


def _dirs(text: str | None) -> list[Path]:
    return [Path(d) for d in (text or "").split(os.pathsep) if d]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m controller", description="meshkeeper controller")
    ap.add_argument(
        "--host",
        default=env("MESHKEEPER_HOST", "127.0.0.1"),
        help="interface to bind (default 127.0.0.1: nothing public by default)",
    )
    ap.add_argument("--port", type=int, default=int(env("MESHKEEPER_PORT", "8765")))
    ap.add_argument(
        "--allowed-hosts",
        default=env("MESHKEEPER_ALLOWED_HOSTS", "*"),
        help="comma-separated Host header values the API answers (a leading '*.' matches "
        "subdomains), others get 400: a browser page on a rebound DNS name cannot reach it. "
        "Default '*' (any); `meshkeeper up` gives 127.0.0.1,localhost",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=float(env("MESHKEEPER_REQUEST_TIMEOUT_S", "10")),
        help="seconds a client has to send a whole request (headers and body) once connected "
        "or after the previous response; a slower one is disconnected (slowloris)",
    )
    ap.add_argument(
        "--redis-url",
        help="Redis URL without a password (default redis://127.0.0.1:6379/0): a command "
        "line is readable by every local user (ps). A URL with credentials goes in env "
        "REDIS_URL or a 0600 file, --redis-url-file",
    )
    ap.add_argument(
        "--redis-url-file",
        type=Path,
        default=env("REDIS_URL_FILE"),
        help="file holding the Redis URL, credentials included (env REDIS_URL_FILE)",
    )
    ap.add_argument(
        "--redis-provisioner-url-file",
        type=Path,
        default=env("REDIS_PROVISIONER_URL_FILE"),
        help="file holding the Redis URL of the user that manages agent users (env "
        "REDIS_PROVISIONER_URL_FILE, or the URL itself in env REDIS_PROVISIONER_URL); without "
        "one no agent can join",
    )
    ap.add_argument("--prefix", default=env("MESHKEEPER_PREFIX", "mk:"), help="Redis key prefix")
    ap.add_argument("--lease-ttl", type=float, default=3.0, help="leader lease, seconds")
    ap.add_argument(
        "--worker-alive",
        type=float,
        default=3.0,
        help="a worker silent this long (s) is not placed on",
    )
    ap.add_argument(
        "--rdzv-ports",
        type=_port_range,
        default=env("MESHKEEPER_RDZV_PORTS", "20000-32000"),  # argparse applies `type`
        help="rendezvous ports to pick from, LOW-HIGH (env MESHKEEPER_RDZV_PORTS)",
    )
    ap.add_argument(
        "--agent-redis-url",
        dest="agent_url",
        help="Redis URL handed to agents started with --controller (default: --redis-url), "
        "without credentials: each agent gets its own user's (env MESHKEEPER_AGENT_REDIS_URL)",
    )
    ap.add_argument(
        "--auth-file",
        default=env("MESHKEEPER_AUTH_FILE"),
        help="API token hashes, JSON (docs/security.md); env MESHKEEPER_API_TOKEN and "
        "MESHKEEPER_SCRAPE_TOKEN add plaintext tokens",
    )
    ap.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="no authentication at all: every caller is admin (throwaway experiments only)",
    )
    ap.add_argument(
        "--tls-cert", default=env("MESHKEEPER_TLS_CERT"), help="serve HTTPS: PEM certificate"
    )
    ap.add_argument(
        "--tls-key", default=env("MESHKEEPER_TLS_KEY"), help="serve HTTPS: PEM private key"
    )
    ap.add_argument(
        "--data-root",
        type=Path,
        action="append",
        default=_dirs(env("MESHKEEPER_DATA_ROOTS")),
        help="a directory whose files jobs may train on (data.source text:/tokens:); "
        "repeatable; env MESHKEEPER_DATA_ROOTS (':'-separated). None: synthetic only",
    )
    ap.add_argument(
        "--checkpoint-root-allow",
        type=Path,
        action="append",
        default=_dirs(env("MESHKEEPER_CHECKPOINT_ROOTS")),
        help="a directory a spec's checkpoint.root may lie in (the agents' "
        "--checkpoint-root or below it); repeatable; env MESHKEEPER_CHECKPOINT_ROOTS. "
        "None: specs may not set checkpoint.root",
    )
    ap.add_argument(
        "--allow-chaos",
        action="store_true",
        help="accept specs with a chaos section (fault injection: bit flips in a rank's state, "
        "a rank's memory limit) "
        'from admin tokens; for test clusters only (docs/security.md, "Fault injection")',
    )
    ap.add_argument(
        "--priority-classes",
        type=Path,
        help="YAML list of {name, value, preempts}, replacing the built-in classes low (0), "
        "default (100) and high (1000, preempts); it must name a class default "
        '(docs/control-plane.md, "Priorities and preemption")',
    )
    ap.add_argument(
        "--quota",
        type=_quota,
        action="append",
        default=[],
        help="OWNER=RANKS: most ranks OWNER's jobs may run at once; repeatable",
    )
    limits = PoolLimits()
    ap.add_argument(
        "--max-quarantine",
        type=_seconds,
        default=limits.max_quarantine_s,
        help="the longest fault_tolerance.quarantine_s a non-admin spec may ask for, seconds "
        f"(default {limits.max_quarantine_s:g}): quarantine keeps a shared worker from everyone",
    )
    ap.add_argument(
        "--min-straggler-slowdown",
        type=float,
        default=limits.min_straggler_slowdown,
        help="the lowest straggler.slowdown a non-admin spec may use with action replace "
        f"(default {limits.min_straggler_slowdown:g})",
    )
    ap.add_argument(
        "--min-straggler-window",
        type=int,
        default=limits.min_straggler_window_steps,
        help="the fewest straggler.window_steps a non-admin spec may use with action replace "
        f"(default {limits.min_straggler_window_steps})",
    )
    ap.add_argument(
        "--max-pending-jobs",
        type=_count,
        default=limits.max_pending_jobs,
        help="jobs one owner may have waiting to start; more get 429 (default "
        f"{limits.max_pending_jobs}; 0: no cap)",
    )
    ap.add_argument(
        "--plan-concurrency",
        type=_count,
        default=limits.plan_concurrency,
        help=f"POST /v1/plan calls running at once (default {limits.plan_concurrency})",
    )
    ap.add_argument(
        "--plans-per-minute",
        type=_count,
        default=limits.plans_per_minute,
        help="POST /v1/plan calls one owner may start a minute "
        f"(default {limits.plans_per_minute})",
    )
    ap.add_argument(
        "--default-quota",
        type=_ranks,
        default=None,
        metavar="RANKS",
        help="the quota of owners without --quota (default: unlimited)",
    )
    ap.add_argument(
        "--reserve-after",
        type=float,
        default=300.0,
        help="seconds a waiting job that fits the pool lets later jobs start before it "
        "(backfill); after that it has first claim on freed workers",
    )
    ap.add_argument(
        "--job-retention",
        type=_seconds,
        default=env("MESHKEEPER_JOB_RETENTION", str(7 * 86400)),
        help="seconds a finished job stays queryable before it is archived and deleted "
        "(env MESHKEEPER_JOB_RETENTION; default 7 days)",
    )
    ap.add_argument(
        "--worker-retention",
        type=_seconds,
        default=env("MESHKEEPER_WORKER_RETENTION", "3600"),
        help="seconds a silent or departed worker's records stay before they are forgotten "
        "(env MESHKEEPER_WORKER_RETENTION)",
    )
    ap.add_argument(
        "--archive-dir",
        type=Path,
        default=env("MESHKEEPER_ARCHIVE_DIR"),
        help="directory where expired jobs are archived as JSON lines (jobs.jsonl); "
        "without it they are only deleted (env MESHKEEPER_ARCHIVE_DIR)",
    )
    ap.add_argument("--log-level", default=env("MESHKEEPER_LOG_LEVEL", "info"))
    args = ap.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together (give both, or neither for plain HTTP)")
    return args


# A young generation this big lets a reconcile pass's garbage die young (see for_a_big_heap)
GC_YOUNG = 100_000
# How long a thread may hold the GIL while another waits: a REST call that waits on Redis
# gets it back sooner from a CPU-bound pass (Python's default is 5 ms at every wait)
GIL_SWITCH_S = 0.001


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class SecretOnCommandLine(ValueError):
    """A password given where every local user can read it; the message names the fix."""


def redis_url(args: argparse.Namespace, environ: dict[str, str]) -> str:
    """The controller's Redis URL: --redis-url-file, else env REDIS_URL, else --redis-url
    (refused if it holds a password: /proc/PID/cmdline is world-readable, the environment and
    a 0600 file are not), else the local default."""
    for flag, given in (("--redis-url", args.redis_url), ("--agent-redis-url", args.agent_url)):
        if given and holds_secret(given):
            raise SecretOnCommandLine(
                f"{flag} holds a password, and every local user can read a command line (ps): "
                "give the controller's URL in env REDIS_URL or a 0600 file (--redis-url-file); "
                "agents get credentials of their own at join"
            )
    given = _from_file("--redis-url-file", args.redis_url_file)
    return given or environ.get("REDIS_URL") or args.redis_url or DEFAULT_REDIS_URL


def provisioner_url(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
    """The agent provisioner's Redis URL: --redis-provisioner-url-file, else env
    REDIS_PROVISIONER_URL, else None (no agent can join)."""
    given = _from_file("--redis-provisioner-url-file", args.redis_provisioner_url_file)
    return given or environ.get("REDIS_PROVISIONER_URL") or None


def _from_file(flag: str, path: Path | None) -> str | None:
    if not path:
        return None
    try:
        return path.read_text().strip()
    except OSError as e:
        raise SecretOnCommandLine(f"{flag} {path}: cannot read it ({e.strerror})") from None


def for_a_big_heap() -> None:
    """Tune the interpreter for the controller's heap and threads. At scale the heap is large
    and long-lived (every worker's report mirrored, the assignments of every running job,
    registrations), while each pass allocates a burst that dies at its end. With CPython's
    defaults (a young collection every 700 allocations) those bursts are promoted, and a full
    collection of the whole heap follows every fraction of a second: 50-600 ms pauses, a
    fifth of wall time at 16,384 ranks (issue 15), stopping every thread, the REST API's
    too. What startup built (modules, the app) is frozen out of collections for good."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 10, 10)
    sys.setswitchinterval(GIL_SWITCH_S)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.request_timeout > 0:
        print("controller: --request-timeout must be a number of seconds > 0", file=sys.stderr)
        return 2
    try:
        url = redis_url(args, dict(os.environ))
        provisioner = provisioner_url(args, dict(os.environ))
    except SecretOnCommandLine as e:
        print(f"controller: {e}", file=sys.stderr)
        return 2
    try:
        auth = Auth.load(args.auth_file, os.environ, insecure=args.insecure_no_auth)
    except TokenError as e:
        print(f"controller: {e}", file=sys.stderr)
        return 2
    if (why := refuse_without_admin(auth)) is not None:
        print(f"controller: {why}", file=sys.stderr)
        return 2
    try:
        priorities = PriorityClasses()
        if args.priority_classes:
            priorities = priority_classes.load(args.priority_classes)
    except ValueError as e:
        print(f"controller: --priority-classes {e}", file=sys.stderr)
        return 2
    if args.allow_chaos:  # loud, like --insecure-no-auth: it is a test cluster's setting
        logging.getLogger("meshkeeper.admission").warning(
            "--allow-chaos: admin tokens may submit fault injection "
            "(chaos: bit flips, memory limits)"
        )
    import uvicorn  # after argument errors, which need no server

    from controller.app import create_app

    if provisioner is None:
        logging.getLogger("meshkeeper.controller").warning(
            "no REDIS_PROVISIONER_URL: agents cannot join (only --insecure-direct-redis agents "
            "run); docs/security.md"
        )
    cfg = ControllerConfig(
        redis_url=url,
        provisioner_url=provisioner,
        prefix=args.prefix,
        lease_ttl_s=args.lease_ttl,
        scheduler=SchedulerConfig(
            args.worker_alive,
            args.rdzv_ports,
            reserve_after_s=args.reserve_after,
            quotas=Quotas(args.default_quota, dict(args.quota)),
            priorities=priorities,
        ),
        agent_redis_url=args.agent_url or os.environ.get("MESHKEEPER_AGENT_REDIS_URL"),
        admission=AdmissionConfig(
            tuple(args.data_root), tuple(args.checkpoint_root_allow), args.allow_chaos
        ),
        retention=RetentionConfig(args.job_retention, args.worker_retention, args.archive_dir),
        pool_limits=PoolLimits(
            args.max_quarantine,
            args.min_straggler_slowdown,
            args.min_straggler_window,
            args.max_pending_jobs or None,
            max(1, args.plan_concurrency),
            max(1, args.plans_per_minute),
        ),
    )
    try:
        ctl = Controller(cfg)
    except ValueError as e:  # a Redis URL it cannot use (services/redis_url.py names the part)
        print(f"controller: --redis-url: {e}", file=sys.stderr)
        return 2
    app = create_app(
        ctl, auth, hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    )
    for_a_big_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        http=request_deadline(args.request_timeout),
        ssl_certfile=args.tls_cert,
        ssl_keyfile=args.tls_key,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
