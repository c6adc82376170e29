"""`python -m worker --controller URL --join-token-file F`: one worker agent.

The agent joins through the controller with the join token (POST /v1/agents/join): the
controller registers the worker and answers with a Redis URL carrying the agent's own ACL
user, which may write only this worker's keys (docs/security.md). `--insecure-direct-redis
URL` skips the join and registers straight into Redis, for a Redis without ACLs on a trusted
machine only: whoever can write that Redis can then become a worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path

import psutil
import redis

from services.paths import SNAPSHOT_ROOT as DEFAULT_SNAPSHOT_ROOT
from services.store import WORKER_ID_RE, Store, wait_for_redis
from services.tokens import TokenError, read_token
from worker.agent.agent import Agent, AgentConfig, default_address
from worker.agent.joining import Credentials, Joiner, Rejoin, via
from worker.agent.metrics_endpoint import AgentMetrics
from worker.devices import discover
from worker.shm_headroom import snapshot_capacity

log = logging.getLogger("meshkeeper.agent")


def _label(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE, like host=node-3 or rack=r1")
    return k, v


def _gpus() -> int:
    """The GPUs CUDA will show this worker's trainers (NVML, CUDA_VISIBLE_DEVICES applied)."""
    return len(discover())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m worker", description="meshkeeper worker agent")
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--controller",
        default=env("MESHKEEPER_CONTROLLER"),
        help="controller URL; the agent joins there with the join token",
    )
    src.add_argument(
        "--insecure-direct-redis",
        metavar="URL",
        help="register straight into Redis at URL, without joining (trusted "
        "machines only: anyone who can write that Redis can become a worker)",
    )
    ap.add_argument(
        "--join-token-file",
        type=Path,
        help="file holding the join token (or env MESHKEEPER_JOIN_TOKEN, "
        "MESHKEEPER_JOIN_TOKEN_FILE; `meshkeeper up` writes secrets/join-token)",
    )
    ap.add_argument(
        "--redis-address",
        metavar="HOST:PORT",
        default=env("MESHKEEPER_REDIS_ADDRESS"),
        help="reach Redis here instead of where the controller says (a tunnel or proxy)",
    )
    ap.add_argument(
        "--ca-file",
        default=env("MESHKEEPER_CA_FILE"),
        help="CA certificate (PEM) that signed the controller's HTTPS certificate",
    )
    ap.add_argument(
        "--prefix",
        default=env("MESHKEEPER_PREFIX", "mk:"),
        help="Redis key prefix (--insecure-direct-redis only; a join is told it)",
    )
    ap.add_argument(
        "--fabric",
        choices=("auto", "infiniband", "tcp"),
        default=env("MESHKEEPER_FABRIC") or "auto",
        help="the network this host reaches other hosts over, for the planner: infiniband "
        "(RDMA: InfiniBand or RoCE), tcp (sockets), or auto: infiniband where the kernel "
        "lists an RDMA device (/sys/class/infiniband), else tcp (env MESHKEEPER_FABRIC)",
    )
    ap.add_argument(
        "--id",
        default=env("MESHKEEPER_WORKER_ID"),
        help="worker id (default: hostname plus a random suffix)",
    )
    ap.add_argument(
        "--host-name",
        # on Kubernetes the node (the downward API's spec.nodeName, which the chart sets),
        # not the pod's hostname: two pods of one node share its NVLink and its fate
        default=env("MESHKEEPER_HOST_NAME") or env("MESHKEEPER_NODE_NAME") or socket.gethostname(),
        help="the host this worker runs on: TP groups stay on one host, buddy copies go to "
        "another (env MESHKEEPER_HOST_NAME, else MESHKEEPER_NODE_NAME, else the hostname)",
    )
    ap.add_argument(
        "--address",
        default=env("MESHKEEPER_ADDRESS") or default_address(),
        help="address other workers reach this one at (rendezvous)",
    )
    ap.add_argument("--label", type=_label, action="append", default=[], help="KEY=VALUE")
    gpus = _gpus()
    ap.add_argument(
        "--devices",
        type=int,
        default=gpus or 1,
        help="ranks this worker can run (default: its visible GPUs, else 1)",
    )
    ap.add_argument(
        "--warm",
        type=int,
        default=None,
        help="0: start every trainer cold; above 0: fork them from a trainer zygote that "
        "imported torch once (default: devices)",
    )
    ap.add_argument(
        "--run-dir",
        type=Path,
        default=Path(env("MESHKEEPER_RUN_DIR", ".meshkeeper")),
        help="logs, specs and metrics files of this worker's trainers",
    )
    ap.add_argument("--checkpoint-root", type=Path, default=env("MESHKEEPER_CHECKPOINT_ROOT"))
    ap.add_argument(
        "--data-root",
        type=Path,
        action="append",
        default=[Path(d) for d in env("MESHKEEPER_DATA_ROOTS", "").split(os.pathsep) if d],
        help="a directory jobs may read text:/tokens: data from; repeatable (env "
        "MESHKEEPER_DATA_ROOTS, ':'-separated). None: synthetic data only",
    )
    ap.add_argument(
        "--heartbeat",
        type=float,
        default=0.5,
        help="seconds between heartbeats while idle; serving a job, its fault_tolerance."
        "heartbeat_s applies",
    )
    ap.add_argument(
        "--keep-run-dirs",
        type=int,
        default=16,
        help="newest per-generation run directories (logs, step records) kept under "
        "--run-dir/jobs; older ones are deleted",
    )
    ap.add_argument(
        "--snapshot-dir",
        type=Path,
        default=env("MESHKEEPER_SNAPSHOT_DIR"),
        help="where this worker's trainers keep in-memory snapshots and the copies they hold "
        "for buddies, under <dir>/<worker id> (default /dev/shm/meshkeeper: host shared "
        "memory; on Kubernetes mount a memory-backed emptyDir at /dev/shm)",
    )
    ap.add_argument("--stop-grace", type=float, default=3.0, help="SIGTERM -> SIGKILL, seconds")
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("MESHKEEPER_METRICS_PORT", "9400")),
        help="Prometheus endpoint port (0: none)",
    )
    ap.add_argument("--metrics-host", default=env("MESHKEEPER_METRICS_HOST", "127.0.0.1"))
    ap.add_argument(
        "--peak-flops",
        type=float,
        default=float(env("MESHKEEPER_PEAK_FLOPS", "0")),
        help="peak FLOP/s of one rank's device, for the MFU metric (default: on an A100, H100 "
        "or H200 its datasheet's dense peak at each job's precision, from NVML's device name; "
        "else a CPU estimate, 1e11 per core)",
    )
    ap.add_argument("--log-level", default=env("MESHKEEPER_LOG_LEVEL", "info"))
    args = ap.parse_args(argv)
    if not (args.insecure_direct_redis or args.controller):
        ap.error(
            "give --controller URL (env MESHKEEPER_CONTROLLER) and the join token "
            "(--join-token-file F, env MESHKEEPER_JOIN_TOKEN or MESHKEEPER_JOIN_TOKEN_FILE)"
        )
    if args.id and not WORKER_ID_RE.fullmatch(args.id):
        ap.error(
            f"--id {args.id!r}: use letters, digits, '.', '_' and '-' (at most 64, first a "
            "letter or digit)"
        )
    if args.redis_address and not _host_port(args.redis_address):
        ap.error(f"--redis-address {args.redis_address!r}: use HOST:PORT, like 10.0.0.5:6380")
    if args.devices < 1 or (args.warm is not None and args.warm < 0):
        ap.error("--devices must be >= 1 and --warm >= 0")
    if gpus and args.devices > gpus:  # each rank needs a GPU of its own (NCCL)
        ap.error(f"--devices {args.devices}: only {gpus} GPU(s) visible (CUDA_VISIBLE_DEVICES)")
    return args


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit())


def join_token(args: argparse.Namespace) -> str:
    try:
        token = (
            args.join_token_file.read_text().strip()
            if args.join_token_file
            else read_token(var="MESHKEEPER_JOIN_TOKEN")
        )
    except OSError as e:
        raise SystemExit(
            f"agent: cannot read --join-token-file {args.join_token_file}: {e.strerror}"
        ) from None
    except TokenError as e:
        raise SystemExit(f"agent: {e}") from None
    if not token:
        raise SystemExit(
            "agent: no join token: pass --join-token-file F or set MESHKEEPER_JOIN_TOKEN "
            "(or MESHKEEPER_JOIN_TOKEN_FILE); `meshkeeper up` writes {run-dir}/secrets/join-token"
        )
    return token


def device_memory(devices: int) -> tuple[str, int]:
    """("cuda", the smallest visible GPU's memory) where NVML finds GPUs, else ("cpu", host
    RAM per device)."""
    gpus = discover()
    if gpus:
        return "cuda", min(g.memory_bytes for g in gpus)
    return "cpu", psutil.virtual_memory().total // devices


def host_fabric(choice: str, rdma_devices: Path = Path("/sys/class/infiniband")) -> str:
    """`--fabric`, with auto resolved: NCCL takes its IB transport (InfiniBand or RoCE) only
    where the kernel lists an RDMA device, and falls back to sockets otherwise."""
    if choice != "auto":
        return choice
    try:
        return "infiniband" if any(rdma_devices.iterdir()) else "tcp"
    except OSError:  # no RDMA stack at all
        return "tcp"


def joiner(args: argparse.Namespace, cfg: AgentConfig) -> Joiner:
    """How this agent joins through the controller (worker/agent/joining.py)."""
    token, (kind, memory) = join_token(args), device_memory(cfg.devices)
    snapshot_bytes = snapshot_capacity(cfg.snapshots, kind == "cuda")
    try:
        verify = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else True
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(
            f"agent: --ca-file {args.ca_file}: cannot load it as a PEM CA certificate ({e})"
        ) from None
    body = {
        "id": cfg.wid,
        "host": cfg.host,
        "address": cfg.address,
        "devices": cfg.devices,
        "labels": cfg.labels,
        "memory_bytes": memory,
        "device_kind": kind,
        "snapshot_bytes": snapshot_bytes,
        "fabric": host_fabric(args.fabric),
        "pid": os.getpid(),
        "run_dir": str(cfg.run_dir),
    }
    return Joiner(
        args.controller, token, body, verify, cfg.run_dir / "credential", args.redis_address
    )


def register_directly(store: Store, cfg: AgentConfig) -> None:
    """--insecure-direct-redis: the agent writes its own registration, `joined_at` included."""
    kind, memory = device_memory(cfg.devices)
    store.register_worker(
        cfg.wid,
        {
            "host": cfg.host,
            "address": cfg.address,
            "labels": {"host": cfg.host, **cfg.labels},
            "devices": cfg.devices,
            "memory_bytes": memory,
            "device_kind": kind,
            "snapshot_bytes": snapshot_capacity(cfg.snapshots, kind == "cuda"),
            "pid": os.getpid(),
            "state": "idle",
            "run_dir": str(cfg.run_dir),
            "started_at": time.time(),
            "joined_at": store.now(),
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stopping = threading.Event()
    agent: list[Agent] = []

    def on_signal(signum, _frame):
        stopping.set()
        if agent:
            agent[0].stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # a node name may be 253 characters; an id is at most 64 (it goes into ACL key patterns)
    wid = args.id or f"{args.host_name[:59]}-{secrets.token_hex(2)}"
    cfg = AgentConfig(
        wid=wid,
        host=args.host_name,
        address=args.address,
        labels=dict(args.label),
        run_dir=args.run_dir.resolve(),
        devices=args.devices,
        warm=args.devices if args.warm is None else args.warm,
        heartbeat_s=args.heartbeat,
        stop_grace_s=args.stop_grace,
        checkpoint_root=args.checkpoint_root.resolve() if args.checkpoint_root else None,
        data_roots=tuple(args.data_root),
        keep_run_dirs=args.keep_run_dirs,
        # per worker id: agents sharing a host (and a --snapshot-dir) never share files
        snapshot_root=(args.snapshot_dir or DEFAULT_SNAPSHOT_ROOT).resolve() / wid,
    )
    rejoin = None
    if args.controller:
        joins = joiner(args, cfg)
        joined = joins.until_joined(stopping)
        if joined is None:  # stopped before the controller answered
            return 0
        redis_url, prefix = joined
        credentials = Credentials(redis_url)
        store = Store(redis_url, prefix, credentials=credentials)
        rejoin = Rejoin(joins, credentials)
    else:
        log.warning(
            "--insecure-direct-redis: registering without a join; anyone who can write "
            "this Redis can become a worker (docs/security.md)"
        )
        store = Store(via(args.insecure_direct_redis, args.redis_address), args.prefix)
        try:
            wait_for_redis(store, 60)
            register_directly(store, cfg)
        except redis.RedisError as e:
            raise SystemExit(
                f"agent: cannot register in Redis at --insecure-direct-redis: {e}"
            ) from None
    gpus = discover()
    metrics = AgentMetrics(args.peak_flops or None, cfg.devices, gpus[0].name if gpus else None)
    agent.append(Agent(cfg, store, metrics, rejoin))
    metrics.watch(agent[0].snapshot)
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port, store, cfg.wid, cfg.address)
    if stopping.is_set():
        return 0
    agent[0].run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
