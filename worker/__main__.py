"""`python -m worker --redis-url URL` (or `--controller URL`): one worker agent."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from services.store import Backoff, Store
from worker.agent import Agent, AgentConfig, default_address
from worker.metrics import AgentMetrics

log = logging.getLogger("meshkeeper.agent")


def _label(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE, like host=node-3 or rack=r1")
    return k, v


def _gpus() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) or 1
    except OSError:
        return 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m worker", description="meshkeeper worker agent")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--redis-url", default=env("REDIS_URL"))
    src.add_argument("--controller", default=env("MESHKEEPER_CONTROLLER"),
                     help="controller URL; the agent asks it where Redis is")
    ap.add_argument("--prefix", default=env("MESHKEEPER_PREFIX", "mk:"))
    ap.add_argument("--id", default=env("MESHKEEPER_WORKER_ID"),
                    help="worker id (default: hostname plus a random suffix)")
    ap.add_argument("--host-name", default=env("MESHKEEPER_HOST_NAME", socket.gethostname()),
                    help="the host this worker runs on; TP groups stay on one host")
    ap.add_argument("--address", default=env("MESHKEEPER_ADDRESS") or default_address(),
                    help="address other workers reach this one at (rendezvous)")
    ap.add_argument("--label", type=_label, action="append", default=[], help="KEY=VALUE")
    ap.add_argument("--devices", type=int, default=_gpus(), help="ranks this worker can run")
    ap.add_argument("--warm", type=int, default=None, help="warm trainer processes (default: devices)")
    ap.add_argument("--run-dir", type=Path, default=Path(env("MESHKEEPER_RUN_DIR", ".meshkeeper")),
                    help="logs, specs and metrics files of this worker's trainers")
    ap.add_argument("--checkpoint-root", type=Path, default=env("MESHKEEPER_CHECKPOINT_ROOT"))
    ap.add_argument("--data-root", type=Path, action="append",
                    default=[Path(d) for d in env("MESHKEEPER_DATA_ROOTS", "").split(os.pathsep) if d],
                    help="a directory jobs may read text:/tokens: data from; repeatable (env "
                         "MESHKEEPER_DATA_ROOTS, ':'-separated). None: synthetic data only")
    ap.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    ap.add_argument("--stop-grace", type=float, default=3.0, help="SIGTERM -> SIGKILL, seconds")
    ap.add_argument("--metrics-port", type=int, default=int(env("MESHKEEPER_METRICS_PORT", "9400")),
                    help="Prometheus endpoint port (0: none)")
    ap.add_argument("--metrics-host", default=env("MESHKEEPER_METRICS_HOST", "127.0.0.1"))
    ap.add_argument("--peak-flops", type=float, default=float(env("MESHKEEPER_PEAK_FLOPS", "0")),
                    help="peak FLOP/s of one rank's device, for the MFU metric (default: a CPU "
                         "estimate, 1e11 per core; set it on GPU nodes, e.g. 9.89e14 for H100 bf16)")
    ap.add_argument("--log-level", default=env("MESHKEEPER_LOG_LEVEL", "info"))
    args = ap.parse_args(argv)
    if not (args.redis_url or args.controller):
        ap.error("give --redis-url URL or --controller URL (or set REDIS_URL)")
    if args.devices < 1 or (args.warm is not None and args.warm < 0):
        ap.error("--devices must be >= 1 and --warm >= 0")
    return args


def bootstrap(controller: str, stop: list[bool]) -> tuple[str, str]:
    """Ask the controller for the Redis URL and prefix, retrying until it answers."""
    backoff = Backoff(cap=5.0)
    url = controller.rstrip("/") + "/v1/agent/bootstrap"
    while not stop:
        try:
            r = httpx.get(url, timeout=5.0)
            r.raise_for_status()
            body = r.json()
            return body["redis_url"], body["prefix"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.warning("controller %s not answering (%s); retrying", controller, e)
            time.sleep(backoff.next())
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stopping: list[bool] = []
    agent: list[Agent] = []

    def on_signal(signum, _frame):
        stopping.append(True)
        if agent:
            agent[0].stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    redis_url, prefix = (args.redis_url, args.prefix) if args.redis_url else bootstrap(args.controller, stopping)
    wid = args.id or f"{args.host_name}-{secrets.token_hex(2)}"
    cfg = AgentConfig(wid=wid, host=args.host_name, address=args.address, labels=dict(args.label),
                      run_dir=args.run_dir.resolve(), devices=args.devices,
                      warm=args.devices if args.warm is None else args.warm,
                      heartbeat_s=args.heartbeat, stop_grace_s=args.stop_grace,
                      checkpoint_root=args.checkpoint_root.resolve() if args.checkpoint_root else None,
                      data_roots=tuple(args.data_root))
    metrics = AgentMetrics(args.peak_flops or None, cfg.devices)
    agent.append(Agent(cfg, Store(redis_url, prefix), metrics))
    metrics.watch(agent[0])
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port)
    if stopping:
        return 0
    agent[0].run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
