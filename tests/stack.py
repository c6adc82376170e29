"""The local stack the tests run against: a real redis-server on a free port, real controller
processes (uvicorn), real agents with warm trainers, real HTTP. Nothing is mocked.

One stack (Redis with AOF and auth on, a controller with an auth file, 8 agents serving their
Prometheus endpoints) is shared by the whole session: by tests/integration, tests/chaos and
tests/observability (the fixtures live in tests/conftest.py). Starting agents means importing
torch in their warm trainers, so a second stack would double that cost. Each test gets it idle
and healthy (`stack` fixture) and uses its own job, which ends or is cancelled; tests that kill
a controller, Redis or a worker leave it whole again. What stays is cumulative by nature
(event logs of ended jobs, the controller's counters): tests read their own job's series, or
the change across their own scrapes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import psutil
import redis

from bench.common import own_memory
from services.client import ApiError, Client
from services.procs import free_port, signal_group, stop_all
from services.redis_url import with_credentials
from services.secrets import write_secret
from services.store import Store, acl_file, wait_for_redis
from services.tokens import new_token, write_auth_file
from tests.netns import TestNetwork
from worker.progress import CHAOS_ENV

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
ENV.pop("REDIS_URL", None)
ENV.pop("MESHKEEPER_URL", None)
WORKERS = 8


@dataclass(frozen=True)
class TestSecrets:
    """One test stack's secrets: API tokens of every role, the agents' join token, the Redis
    passwords, and the controller's auth file (hashes only) written under `work`."""

    __test__ = False  # a helper, not a test class

    admin_token: str
    viewer_token: str
    submitter_token: str
    scrape_token: str
    join_token: str
    auth_file: Path
    redis_admin_password: str
    redis_controller_password: str
    redis_provisioner_password: str

    @property
    def join_token_file(self) -> Path:
        """The join token in a 0600 file beside the auth file (agents read it from there)."""
        return self.auth_file.parent / "join-token"

    @classmethod
    def create(cls, work: Path) -> TestSecrets:
        work.mkdir(parents=True, exist_ok=True)
        tokens = {role: new_token() for role in ("admin", "viewer", "submitter", "scrape")}
        join = new_token()
        auth = write_auth_file(
            work / "auth.json", [(role, role, t) for role, t in tokens.items()], join
        )
        fd = os.open(work / "join-token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(join)
        return cls(
            tokens["admin"],
            tokens["viewer"],
            tokens["submitter"],
            tokens["scrape"],
            join,
            auth,
            new_token(),
            new_token(),
            new_token(),
        )


def wait_until(fn: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll `fn` until it returns something truthy; fail naming `what` and the last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (ApiError, redis.RedisError) as e:  # a component restarting: keep polling
            last = e
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


class Proc:
    """A child in its own process group, its output in a log file; `env` defaults to ENV."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name, self.log = name, log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env or ENV,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        signal_group(self.p, sig)
        if sig == signal.SIGKILL:
            self.p.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        stop_all([self.p], grace_s)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def controller_argv(port: int, redis: RedisUrls, secrets_dir: Path, *extra: str) -> list[str]:
    """`python -m controller` on `port` against `redis`, plus `extra` flags. Each URL,
    password and all, goes in a 0600 file under `secrets_dir` (--redis-url-file,
    --redis-provisioner-url-file), as deployed: a command line is readable by every local
    user, and the controller refuses one with a password."""
    secrets_dir.mkdir(parents=True, exist_ok=True)

    def url_file(url: str) -> str:
        name = "redis-url-" + hashlib.sha256(url.encode()).hexdigest()[:8]
        return str(write_secret(secrets_dir / name, url))

    return [
        sys.executable,
        "-m",
        "controller",
        "--port",
        str(port),
        "--redis-url-file",
        url_file(redis.controller_url),
        "--redis-provisioner-url-file",
        url_file(redis.provisioner_url),
        *extra,
    ]


class RedisUrls(Protocol):
    """What a controller is given: its reconcile loop's URL and its provisioner's."""

    controller_url: str
    provisioner_url: str


def self_signed_cert(work: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, made by openssl."""
    cert, key = work / "cert.pem", work / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


class RedisServer:
    """redis-server on a free port with auth on (as everywhere): an aclfile in `work` with the
    `default` user off and users `admin` (`url`: ops and tests), `controller`
    (`controller_url`) and `provisioner` (`provisioner_url`); agent users the controller adds
    at join are saved to it and survive a restart. AOF with fsync on every write, so a SIGKILL
    loses nothing. With `tls` (a PEM certificate that is its own CA, and its key) it serves
    only TLS, and the URLs are rediss://. `bind`: the addresses it listens on (the URLs name
    the first; `url_on` another)."""

    def __init__(
        self,
        work: Path,
        secrets: TestSecrets | None = None,
        prefix: str = "mk:",
        tls: tuple[Path, Path] | None = None,
        bind: tuple[str, ...] = ("127.0.0.1",),
    ):
        self.work, self.port, self.prefix, self.tls = work, free_port(), prefix, tls
        self.bind = bind
        self.secrets = secrets or TestSecrets.create(work / "secrets")
        self.anonymous_url = (
            f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={tls[0]}"
            if tls
            else f"redis://127.0.0.1:{self.port}/0"
        )
        self.url = with_credentials(self.anonymous_url, "admin", self.secrets.redis_admin_password)
        self.controller_url = with_credentials(
            self.anonymous_url, "controller", self.secrets.redis_controller_password
        )
        self.provisioner_url = with_credentials(
            self.anonymous_url, "provisioner", self.secrets.redis_provisioner_password
        )
        self.proc: Proc | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        users = self.work / "users.acl"
        self.work.mkdir(parents=True, exist_ok=True)
        if not users.exists():  # a restart keeps the agent users saved since
            users.write_text(
                acl_file(
                    self.prefix,
                    self.secrets.redis_admin_password,
                    self.secrets.redis_controller_password,
                    self.secrets.redis_provisioner_password,
                )
            )
        ports = ["--port", str(self.port)]
        if self.tls:
            cert, key = self.tls
            ports = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(cert),
                "--tls-key-file",
                str(key),
                "--tls-ca-cert-file",
                str(cert),
                "--tls-auth-clients",
                "no",
            ]
        self.proc = Proc(
            "redis",
            [
                exe,
                *ports,
                "--bind",
                *self.bind,
                "--dir",
                str(self.work),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--aclfile",
                str(users),
            ],
            self.work,
        )
        store = Store(self.url)
        try:
            wait_for_redis(store, 20)
        finally:
            store.close()

    def url_on(self, host: str) -> str:
        """The URL without credentials at `host`, one of the `bind` addresses (what a
        controller hands agents that reach Redis there: --agent-redis-url)."""
        return self.anonymous_url.replace("127.0.0.1", host, 1)

    def kill(self) -> None:
        self.proc.kill(signal.SIGKILL)

    def close(self) -> None:
        stop_all([self.proc.p], 5)


def agent_argv(
    controller_url: str, secrets: TestSecrets, wid: str, work: Path, metrics_port: int = 0
) -> list[str]:
    """An agent's command line: it joins `controller_url` with the join token (read from a
    0600 file, as deployed), runs under `work`/workers/`wid` and checkpoints to
    `work`/checkpoints."""
    return [
        sys.executable,
        "-m",
        "worker",
        "--controller",
        controller_url,
        "--join-token-file",
        str(secrets.join_token_file),
        "--id",
        wid,
        "--address",
        "127.0.0.1",
        "--metrics-port",
        str(metrics_port),
        "--run-dir",
        str(work / "workers" / wid),
        "--checkpoint-root",
        str(work / "checkpoints"),
        "--snapshot-dir",
        str(snapshot_root(work)),
    ]


def snapshot_root(work: Path) -> Path:
    """The agents' --snapshot-dir: host memory of this stack's own, so two test sessions on one
    host (the same worker ids) do not prune each other's snapshots."""
    return Path("/dev/shm/meshkeeper-tests") / hashlib.sha256(str(work).encode()).hexdigest()[:12]


class Controller:
    """A controller process with auth on (its auth file from `secrets`), as deployed. With
    `host` it listens there (--host) instead of on 127.0.0.1, and `url` names it."""

    def __init__(
        self,
        redis: RedisUrls,
        log_dir: Path,
        name: str,
        secrets: TestSecrets,
        extra: list[str] = (),
        host: str | None = None,
    ):
        self.port = free_port(host or "127.0.0.1")
        self.url = f"http://{host or '127.0.0.1'}:{self.port}"
        self.secrets = secrets
        bind = ("--host", host) if host else ()
        self.proc = Proc(
            name,
            controller_argv(
                self.port,
                redis,
                secrets.auth_file.parent,
                *("--log-level", "info", "--auth-file", str(secrets.auth_file), *extra, *bind),
            ),
            log_dir,
        )
        with Client(self.url, timeout=2) as c:
            wait_until(lambda: c.ready() or not self.proc.alive(), 30, f"{name} to answer /readyz")
        assert self.proc.alive(), self.proc.tail()

    def client(self, token: str | None = None, timeout: float = 10.0) -> Client:
        """A client with `token`, by default the admin token."""
        return Client(self.url, token or self.secrets.admin_token, timeout=timeout)

    def health(self) -> dict:
        with Client(self.url, timeout=2) as c:
            return c.http.get("/healthz").json()


class ApiStack:
    """redis-server and one controller, no agents: for tests of the REST API alone."""

    def __init__(self, work: Path):
        self.secrets = TestSecrets.create(work / "secrets")
        self.redis = RedisServer(work / "redis", self.secrets)
        self.redis.work.mkdir(parents=True)
        self.redis.start()
        self.controller = Controller(self.redis, work / "logs", "controller", self.secrets)
        self.url = self.controller.url

    def close(self) -> None:
        stop_all([self.controller.proc.p], 5)
        stop_all([self.redis.proc.p], 5)


class Stack:
    def __init__(
        self,
        work: Path,
        workers: int = WORKERS,
        redis_kind: type = RedisServer,
        hosts: bool = False,
        devices: int = 1,
        shared_checkpoints: bool = True,
        netns: bool = False,
    ):
        """`workers` agents and Redis as `redis_kind(dir, secrets)` builds it: one server, or
        a master, its replica and Sentinels (tests/sentinel_redis.py) that every part reaches
        by a redis+sentinel:// URL. With `hosts`, each agent runs as on a host of its own:
        its own host name, and memory of its own (bench/common.py, `own_memory`), which dies
        with it (`kill_host`). Each agent holds `devices` ranks (`--devices`), as one agent
        per GPU node does. Without `shared_checkpoints` each agent checkpoints to a root of
        its own, as on node-local disks.

        With `netns` too (needs `hosts`, and the one-server RedisServer), each host has a
        network of its own: a network namespace on a private bridge (tests/netns.py), whose
        address is its agent's --address (and metrics address). Agents, trainers and buddy
        copies talk across the bridge, never over a shared loopback. Redis and the controller
        stay in this namespace and listen on the bridge's gateway address (Redis on
        127.0.0.1 too; the controller only there, so `controller.url` names it), and the
        controller hands agents Redis there (--agent-redis-url). Gloo binds the interface
        holding the agent's --address (worker/agent/gloo_interface.py), not the address the
        machine's host name resolves to (loopback here)."""
        if netns and not hosts:
            raise ValueError("netns=True needs hosts=True: a network host has memory of its own")
        self.work, self.workers, self.hosts, self.devices = work, workers, hosts, devices
        self.shared_checkpoints = shared_checkpoints
        self.net = TestNetwork(workers) if netns else None
        # worker id -> the address its agent registers, and serves its metrics at
        self.addresses = {
            f"w{i}": self.net.hosts[i].address if self.net else "127.0.0.1" for i in range(workers)
        }
        self.controllers: list[Controller] = []
        self.agents: dict[str, Proc] = {}
        self.redis = None
        try:
            # the data root of the controller and every agent: datasets and model directories
            self.data = work / "data"
            self.data.mkdir(parents=True, exist_ok=True)
            self.secrets = TestSecrets.create(work / "secrets")
            bind = {"bind": ("127.0.0.1", self.net.gateway)} if self.net else {}
            self.redis = redis_kind(work / "redis", self.secrets, **bind)
            self.redis.work.mkdir(parents=True)
            self.redis.start()
            self.store = Store(self.redis.url)
            self.controller = self.start_controller()
            self.metrics_ports: dict[str, int] = {}  # worker id -> its agent's Prometheus port
            for i in range(workers):
                self.agents[f"w{i}"] = self._agent(f"w{i}")
            self.client = self.controller.client()
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """Stop what a failed __init__ started and remove its network, then let it raise."""
        try:
            stop_all([a.p for a in self.agents.values()], 5)
            stop_all([c.proc.p for c in self.controllers], 5)
            if self.redis is not None and self.redis.proc is not None:
                stop_all([self.redis.proc.p], 5)
        finally:
            if self.net:
                self.net.close()

    def start_controller(self) -> Controller:
        """A controller replica; it accepts fault injection (`chaos`) from the admin token,
        `self.client`'s, for the silent-data-corruption chaos tests, and, as `meshkeeper up`
        does, specs that write under the agents' checkpoint root (checkpoint.export_hf)."""
        on_net = ["--agent-redis-url", self.redis.url_on(self.net.gateway)] if self.net else []
        c = Controller(
            self.redis,
            self.work / "logs",
            f"controller-{len(self.controllers)}",
            self.secrets,
            [
                "--allow-chaos",
                "--data-root",
                str(self.data),
                "--checkpoint-root-allow",
                str(self.work / "checkpoints"),
                *on_net,
            ],
            host=self.net.gateway if self.net else None,
        )
        self.controllers.append(c)
        return c

    def use(self, c: Controller) -> None:
        """Point the shared client at another controller replica."""
        self.controller = c
        self.client.close()
        self.client = c.client()

    def _agent(self, wid: str, redis_url: str | None = None) -> Proc:
        """An agent process, joined through the controller with the join token, serving its
        metrics on a fresh free port; `redis_url` reaches Redis another way (through a fault
        proxy): only its address is used. Its trainers carry the chaos hook (a SIGUSR2 handler
        that makes a rank spin, worker/progress.py; nothing else sends SIGUSR2), so the blame
        test needs no agent restarted with it and again without it."""
        via = (
            ["--redis-address", urlsplit(redis_url).netloc.rpartition("@")[2]] if redis_url else []
        )
        port = self.metrics_ports[wid] = free_port()
        argv = [*agent_argv(self.controller.url, self.secrets, wid, self.work, port), *via]
        argv += ["--data-root", str(self.data)]
        if self.devices > 1:
            argv += ["--devices", str(self.devices)]
        if not self.shared_checkpoints:  # the last --checkpoint-root given wins
            argv += ["--checkpoint-root", str(self.work / "checkpoints" / wid)]
        env = {**ENV, CHAOS_ENV: "1"}
        if self.net:  # the last --address given wins
            argv += ["--address", self.addresses[wid], "--metrics-host", self.addresses[wid]]
        if self.hosts:
            argv = own_memory([*argv, "--host-name", f"host-{wid}"])
        if self.net:  # outermost: `ip netns exec` makes a mount namespace of its own too, and
            # own_memory's, made inside that one, is the one with the host's /dev/shm
            argv = [*self.net.argv_in(int(wid[1:])), *argv]
        return Proc(f"agent-{wid}", argv, self.work / "logs", env)

    def restart_agent(self, wid: str, redis_url: str | None = None) -> Proc:
        """A new agent process with the same worker id (a returning host)."""
        self.agents[wid] = self._agent(wid, redis_url)
        return self.agents[wid]

    def kill_worker(self, wid: str, trainer_pids: list[int] = ()) -> None:
        """A whole worker dies at once, as a host would: SIGKILL to the agent's process group
        and to every trainer's (trainers run in sessions of their own), back to back."""
        agent = self.agents[wid]
        for pgid in [agent.pid, *trainer_pids]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        agent.p.wait()

    def kill_host(self, wid: str) -> list[int]:
        """A whole host dies at once (a stack with `hosts`): SIGKILL to every process in the
        worker's memory (its mount namespace: the agent, its zygote, its trainers), again
        until none is left, and its memory goes with the last of them. Returns the pids
        killed."""
        ns = os.readlink(f"/proc/{self.agents[wid].pid}/ns/mnt")
        if ns == os.readlink("/proc/self/ns/mnt"):
            raise AssertionError(f"worker {wid} shares this host's memory: use hosts=True")
        killed: set[int] = set()
        for _ in range(100):
            left = [p for p in psutil.process_iter() if _mount_ns(p.pid) == ns]
            if not left:
                break
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
                killed.add(p.pid)
            psutil.wait_procs(left, timeout=1)
        else:
            raise AssertionError(f"processes of worker {wid}'s host outlived SIGKILL: {left}")
        self.agents[wid].p.wait()
        return sorted(killed)

    def idle_workers(self) -> list[str]:
        return [w.id for w in self.client.workers() if w.alive and w.state == "idle" and not w.job]

    def idle(self) -> None:
        """Every part up, no open job and every worker idle (restarting what a test left
        broken, cancelling what it left running)."""
        if not self.redis.proc.alive():
            self.redis.start()
        # One replica, the oldest alive: a standby that a test started and left would answer
        # the next tests, and a standby's /metrics counts no recovery.
        live = [c for c in self.controllers if c.proc.alive()]
        stop_all([c.proc.p for c in live[1:]], 5)
        if not live:
            self.use(self.start_controller())
        elif self.controller is not live[0]:
            self.use(live[0])
        for wid, a in self.agents.items():
            if not a.alive():
                self.agents[wid] = self._agent(wid)
        for j in self.client.jobs(limit=1000):
            if j.phase in ("Pending", "Running", "Recovering"):
                try:
                    self.client.cancel(j.id)
                except ApiError as e:  # 409: it ended between the listing and the cancel
                    if e.status != 409:
                        raise
        n = self.workers
        wait_until(lambda: len(self.idle_workers()) == n, 90, f"all {n} workers idle")

    def scrape(self, wid: str) -> str:
        """The agent's /metrics, as Prometheus scrapes it."""
        url = f"http://{self.addresses.get(wid, '127.0.0.1')}:{self.metrics_ports[wid]}/metrics"
        return httpx.get(url, timeout=5).text

    def scrape_controller(self) -> str:
        """The controller's /metrics with the scrape token, as Prometheus scrapes it."""
        return httpx.get(
            f"{self.controller.url}/metrics",
            timeout=5,
            headers={"Authorization": f"Bearer {self.secrets.scrape_token}"},
        ).text

    def job_dir(self, wid: str, job: str, generation: int = 1) -> Path:
        return self.work / "workers" / wid / "jobs" / job / f"g{generation}"

    def snapshot_dir(self, wid: str, job: str) -> Path:
        """Where worker `wid`'s agent keeps the job's snapshots, one `g<G>` per generation."""
        return snapshot_root(self.work) / wid / job

    def checkpoint_dir(self, job: str, spec: dict) -> Path:
        """Where the agents put a job's checkpoints (with shared checkpoints, the default):
        {checkpoint root}/{job id}/{spec name}."""
        return self.work / "checkpoints" / job / spec["name"]

    def logs(self) -> str:
        return "\n".join(f"--- {c.proc.name}\n{c.proc.tail(1500)}" for c in self.controllers)

    def close(self) -> None:
        try:
            self.client.close()
            stop_all([a.p for a in self.agents.values()], 10)
            stop_all([c.proc.p for c in self.controllers], 5)
            self.redis.close()
            self.store.close()
        finally:
            if self.net:  # after every process in it: then nothing holds a namespace
                self.net.close()


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None  # exited, or not ours to read


def tiny_spec(name: str, **sections: dict) -> dict:
    """A tiny-preset job (4 layers, d_model 64): seconds per run on 2 CPU cores."""
    spec = {
        "name": name,
        "model": {"preset": "tiny"},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2},
        "train": {"steps": 12, "global_batch": 16, "lr": 3e-3, "warmup_steps": 2},
    }
    for k, v in sections.items():
        spec[k] = {**spec.get(k, {}), **v}
    return spec


TERMINAL = ("Succeeded", "Failed", "Cancelled")


def wait_phase(client: Client, job: str, phases: tuple[str, ...], timeout: float):
    """The job once its phase is one of `phases`; fails at once, with the job's conditions,
    when it ends in another (a job that failed in seconds is not waited on for minutes)."""

    def reached():
        j = client.job(job)
        if j.phase in phases:
            return j
        if j.phase in TERMINAL:
            raise AssertionError(f"job {job} ended {j.phase}, not {phases}: {j.conditions}")
        return False

    return wait_until(reached, timeout, f"job {job} to reach {phases}")


def process_groups_alive(pids: list[int]) -> list[int]:
    """Processes still alive (not zombies) whose process group is one of `pids`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp in pids and state != "Z":
            out.append(int(d.name))
    return out
