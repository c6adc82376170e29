"""The local stack behind `meshkeeper up`: redis-server, the controller and N agents as local
processes, one log file each under the run dir, stopped in order and completely
(docs/architecture.md, "Running it").

Every child gets its own process group (Ctrl-C in the terminal reaches only `up`, which
then stops agents first so they stop their trainers) and dies with `up` if `up` is killed.

The stack behaves like a pool (docs/architecture.md, "Running it"): only Ctrl-C ends it.
- An agent that dies (SIGKILL, crash, its host "lost") is replaced by a fresh agent with a new
  worker id, as Kubernetes replaces a pod; the controller recovers the dead agent's ranks as it
  would on any host, and the newcomer joins the free pool as a spare.
- The controller is restarted in place: it keeps nothing but what is in Redis.
- Redis keeps its data in an append-only file under `{run_dir}/redis` (fsync every second),
  and `up` restarts a redis-server that exits on the same port and directory: it reloads every
  job, and the controller and agents reconnect on their own.
A part that keeps dying (RESTARTS exits within RESTART_WINDOW_S) ends the stack with its log's
path: a crash loop is a bug or a broken host to look at, not something to hide.

A SIGKILL of redis-server loses no acknowledged write (Redis write(2)s the AOF before it
replies, and the page cache outlives the process); only a crash of the whole host can lose the
last second.

Auth is on (docs/security.md): `up` generates fresh secrets into `{run_dir}/secrets/`
(cli/secrets.py), runs redis-server with `{run_dir}/redis/users.acl` (`default` off; users
`admin` and `controller`), the controller with its auth file and its own Redis user, and the
agents with the join token: each gets its own Redis user at join, which the controller saves to
the aclfile (ACL SAVE), so a restarted redis-server still knows every agent. No secret is
on any command line (every local user reads those with `ps`): the controller gets its Redis URL
in its environment, the agents the join token's file. The run dir is 0700 and every child runs
with umask 077, so what they write (the aclfile Redis rewrites at each ACL SAVE, logs,
checkpoints) is the stack owner's alone.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tenacity import (
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

from cli.secrets import LocalSecrets
from services.client import ApiError, Client
from services.paths import SNAPSHOT_ROOT
from services.procs import die_with_parent, free_port, stop_all
from services.redis_url import with_credentials
from services.secrets import write_secret
from services.store import Store, acl_file, wait_for_redis


class StackError(RuntimeError):
    pass


def wait_ready(
    url: str,
    workers: int,
    timeout_s: float,
    check: Callable[[], None] = lambda: None,
    token: str | None = None,
) -> bool:
    """Whether the controller at `url` became ready with `workers` live workers in time
    (`token`: any role that reads workers). `check` runs on every poll (it raises to give up
    early); an ApiError (not up yet, restarting) is one more poll."""

    def ready(c: Client) -> bool:
        check()
        return c.ready() and sum(w.alive for w in c.workers()) >= workers

    poll = Retrying(
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(0.2),
        retry=retry_if_exception_type(ApiError) | retry_if_result(lambda ok: not ok),
        retry_error_callback=lambda _: False,
    )
    with Client(url, token, timeout=2.0) as c:
        return poll(ready, c)


@dataclass(frozen=True)
class StackConfig:
    workers: int
    port: int
    run_dir: Path
    redis_url: str | None = (
        None  # None: start our own; else one the controller may manage ACL users on
    )
    warm: int = 1
    allow_chaos: bool = False  # the controller's --allow-chaos (controller/chaos_gate.py)
    priority_classes: Path | None = None  # the controller's --priority-classes


RESTARTS = 5  # at most this many restarts of one part (redis, controller, agents) ...
RESTART_WINDOW_S = 60.0  # ... within this window


@dataclass
class RestartBudget:
    """The recent restarts of one part of the stack (monotonic times)."""

    times: list[float] = field(default_factory=list)

    def spend(self, name: str, code: int | None, log: Path) -> None:
        """Count one more restart of `name`, or raise when it keeps dying."""
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < RESTART_WINDOW_S]
        if len(self.times) >= RESTARTS:
            raise StackError(
                f"{name} exited {len(self.times) + 1} times within {RESTART_WINDOW_S:.0f}s "
                f"(last code {code}); see {log}"
            )
        self.times.append(now)


def redis_argv(exe: str, port: int, data_dir: Path) -> list[str]:
    """The redis-server command line of `meshkeeper up`: AOF in the run dir, fsync every
    second, no RDB snapshots (the AOF alone is reloaded on start); users from the aclfile
    there (`users.acl`), where ACL SAVE keeps the agent users across restarts."""
    return [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--aclfile",
        str(data_dir / "users.acl"),
    ]


def snapshot_root(run_dir: Path) -> Path:
    """Host memory of one stack's own (its agents' --snapshot-dir), the same across restarts of
    that stack: every stack names its workers w0, w1, ..., and an agent prunes what is not its
    own under its root, so two stacks on one host sharing /dev/shm/meshkeeper/w0 deleted each
    other's snapshots."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return SNAPSHOT_ROOT / f"up-{digest}"


def private_child(parent: int) -> None:
    """A child's set-up before exec: what it creates is its owner's alone (umask 077), and it
    dies with `up` (SIGTERM)."""
    os.umask(0o077)
    die_with_parent(signal.SIGTERM, parent)


class LocalStack:
    def __init__(self, cfg: StackConfig, say: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.redis_url = cfg.redis_url or ""  # ours: as user admin (operators, `check`)
        self.controller_redis_url = cfg.redis_url or ""
        self.provisioner_redis_url = cfg.redis_url or ""
        cfg.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(cfg.run_dir, 0o700)  # mkdir's mode does not apply to a directory that existed
        self.secrets = LocalSecrets.create(cfg.run_dir)  # fresh for every stack
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = cfg.run_dir / "logs"
        self.redis_argv: list[str] = []  # set when we run redis-server ourselves
        self.argv: dict[str, list[str]] = {}  # name -> command line, to restart it as it was
        # name -> what it is told in its environment: secrets never go on a command line,
        # which every local user can read (ps, /proc/PID/cmdline)
        self.secret_env: dict[str, dict[str, str]] = {}
        self._restarts: dict[str, RestartBudget] = {}  # "redis", "controller", "agents"
        self._next_agent = cfg.workers  # the id number of the next replacement agent
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def data_dir(self) -> Path:
        """Jobs may train on files under it (the controller's --data-root)."""
        return self.cfg.run_dir / "data"

    @property
    def checkpoint_dir(self) -> Path:
        """Jobs may checkpoint under it (the controller's --checkpoint-root-allow)."""
        return self.cfg.run_dir / "checkpoints"

    def _spawn(self, name: str, argv: list[str], secret_env: dict[str, str] | None = None) -> None:
        self.argv[name] = argv
        self.secret_env[name] = secret_env or {}
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as out:
            root = str(Path(__file__).resolve().parents[1])
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
                # every agent here shares this host's cores: split them instead of each
                # trainer taking all of them (an explicit OMP_NUM_THREADS wins)
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
                or str(max(1, (os.cpu_count() or 1) // max(1, self.cfg.workers))),
                **self.secret_env[name],
            }
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(private_child, os.getpid()),
            )

    def start(self, timeout_s: float = 60.0) -> None:
        """Start everything and wait until the controller is ready and every worker registered."""
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.redis_url:
            self._start_redis(timeout_s)
        py = sys.executable
        data, ckpt = self.data_dir, self.checkpoint_dir
        data.mkdir(exist_ok=True)
        self._spawn(
            "controller",
            [
                py,
                "-m",
                "controller",
                "--host",
                "127.0.0.1",
                "--allowed-hosts",
                "127.0.0.1,localhost",
                "--port",
                str(self.cfg.port),
                "--auth-file",
                str(self.secrets.auth_file),
                "--data-root",
                str(data),
                "--checkpoint-root-allow",
                str(ckpt),
                *(["--allow-chaos"] if self.cfg.allow_chaos else []),
                *(
                    ["--priority-classes", str(self.cfg.priority_classes)]
                    if self.cfg.priority_classes
                    else []
                ),
            ],
            {
                "REDIS_URL": self.controller_redis_url,
                "REDIS_PROVISIONER_URL": self.provisioner_redis_url,
            },
        )
        for i in range(self.cfg.workers):
            self._spawn_agent(f"w{i}")
        self._wait_ready(timeout_s)

    def _spawn_agent(self, wid: str) -> None:
        """An agent with its own run dir and a metrics endpoint on a free port (registered
        with the controller, so Prometheus finds it through /v1/sd/workers)."""
        data, ckpt = self.data_dir, self.checkpoint_dir
        argv = [
            sys.executable,
            "-m",
            "worker",
            "--controller",
            self.url,
            "--join-token-file",
            str(self.secrets.join_token_file),
            "--id",
            wid,
            "--address",
            "127.0.0.1",
            "--run-dir",
            str(self.cfg.run_dir / "workers" / wid),
            "--warm",
            str(self.cfg.warm),
            "--metrics-port",
            str(free_port()),
            "--checkpoint-root",
            str(ckpt),
            "--data-root",
            str(data),
            "--snapshot-dir",
            str(snapshot_root(self.cfg.run_dir)),
        ]
        self._spawn(f"worker-{wid}", argv)

    def _start_redis(self, timeout_s: float) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise StackError(
                "redis-server is not on PATH; install Redis (apt-get install "
                "redis-server) or set REDIS_URL to a running one"
            )
        port = free_port()
        data = self.cfg.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        # A fresh users file with this run's passwords: agents of an earlier run rejoin anyway.
        write_secret(
            data / "users.acl",
            acl_file(
                "mk:",
                self.secrets.redis_admin_password,
                self.secrets.redis_controller_password,
                self.secrets.redis_provisioner_password,
            ).rstrip(),
        )
        self.redis_argv = redis_argv(exe, port, data)
        self._spawn("redis", self.redis_argv)
        base = f"redis://127.0.0.1:{port}/0"
        self.redis_url = with_credentials(base, "admin", self.secrets.redis_admin_password)
        self.controller_redis_url = with_credentials(
            base, "controller", self.secrets.redis_controller_password
        )
        self.provisioner_redis_url = with_credentials(
            base, "provisioner", self.secrets.redis_provisioner_password
        )
        self._wait_redis(timeout_s)

    def _wait_redis(self, timeout_s: float) -> None:
        store = Store(self.redis_url)
        try:
            wait_for_redis(store, timeout_s)
        except Exception:
            raise StackError(f"redis-server did not start; see {self.logs / 'redis.log'}") from None
        finally:
            store.close()

    def _wait_ready(self, timeout_s: float) -> None:
        if not wait_ready(
            self.url, self.cfg.workers, timeout_s, self.check, token=self.secrets.admin_token
        ):
            raise StackError(
                f"the stack was not ready within {timeout_s:.0f}s; see the logs in {self.logs}"
            )

    def check(self) -> None:
        """What `up` does every 0.5 s: put back every part of the stack that exited (see the
        module docstring); raise StackError for one that keeps dying."""
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            if name == "redis" and self.redis_argv:
                self._restart_redis(p.returncode)
            elif name == "controller":
                self._restart_controller(p.returncode)
            elif name.startswith("worker-"):
                self._replace_agent(name, p.returncode)

    def _budget(self, part: str, proc: str, shown: str, code: int | None) -> None:
        """`part`: whose restarts count together; `proc`: the log's name; `shown`: in messages."""
        self._restarts.setdefault(part, RestartBudget()).spend(
            shown, code, self.logs / f"{proc}.log"
        )

    def _restart_controller(self, code: int | None) -> None:
        """In place, same port: the controller keeps nothing outside Redis, and its leader
        lease lets the new process take over once the old lease lapsed."""
        self._budget("controller", "controller", "the controller", code)
        self.say(f"meshkeeper up: the controller exited (code {code}); restarting it")
        self._spawn("controller", self.argv["controller"], self.secret_env["controller"])

    def _replace_agent(self, name: str, code: int | None) -> None:
        """A fresh agent under a new worker id, like a replaced pod. The dead one's trainers
        died with it (PR_SET_PDEATHSIG); the controller blames and recovers its ranks."""
        self._budget("agents", name, name, code)
        del self.procs[name]
        wid = f"w{self._next_agent}"
        self._next_agent += 1
        self.say(
            f"meshkeeper up: {name} exited (code {code}); the controller recovers its ranks; "
            f"starting worker {wid} in its place (it joins as a spare)"
        )
        self._spawn_agent(wid)

    def _restart_redis(self, code: int | None) -> None:
        """Same port, same AOF directory: jobs, workers and the checkpoint pointers come back
        from the AOF; the controller and the agents reconnect by themselves."""
        self._budget("redis", "redis", "redis-server", code)
        self.say(
            f"meshkeeper up: redis-server exited (code {code}); restarting it on "
            f"port {self.redis_argv[2]} from its append-only file and users file in "
            f"{self.cfg.run_dir / 'redis'}"
        )
        self._spawn("redis", self.redis_argv)
        self._wait_redis(30.0)
        self.say(
            "meshkeeper up: redis-server is back; every job was reloaded from its append-only file"
        )

    def stop(self) -> None:
        """Agents first (they stop their trainers), then the controller, then Redis."""
        agents = [p for n, p in self.procs.items() if n.startswith("worker-")]
        stop_all(agents, grace_s=10.0)
        for name in ("controller", "redis"):
            if name in self.procs:
                stop_all([self.procs[name]], grace_s=5.0)
        self.procs.clear()
