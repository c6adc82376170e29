"""The local stack behind `meshkeeper up`: redis-server, the controller and N agents as local
processes, one log file each under the run dir, stopped in order and completely
(docs/architecture.md, "Running it").

Every child gets its own process group (Ctrl-C in the terminal reaches only `up`, which
then stops agents first so they stop their trainers) and dies with `up` if `up` is killed.

Redis keeps its data in an append-only file under `{run_dir}/redis` (fsync every second), and
`up` restarts a redis-server that exits on the same port and directory: it reloads every job,
and the controller and agents reconnect on their own. A SIGKILL of redis-server loses no
acknowledged write (Redis write(2)s the AOF before it replies, and the page cache outlives the
process); only a crash of the whole host can lose the last second.

Auth is on (docs/security.md): `up` generates fresh secrets into `{run_dir}/secrets/`
(cli/secrets.py), runs redis-server with `{run_dir}/redis/users.acl` (`default` off; users
`admin` and `controller`), the controller with its auth file and its own Redis user, and the
agents with the join token: each gets its own Redis user at join, which the controller saves to
the aclfile (ACL SAVE), so a restarted redis-server still knows every agent.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from services.procs import die_with_parent, free_port, stop_all
from services.secrets import write_secret
from services.store import Store, acl_file, wait_for_redis, with_credentials


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


REDIS_RESTARTS = 5  # at most this many restarts of redis-server within REDIS_RESTART_WINDOW_S
REDIS_RESTART_WINDOW_S = 60.0


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


class LocalStack:
    def __init__(self, cfg: StackConfig, say: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.redis_url = cfg.redis_url or ""  # ours: as user admin (operators, `check`)
        self.controller_redis_url = cfg.redis_url or ""
        self.secrets = LocalSecrets.create(cfg.run_dir)  # fresh for every stack
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = cfg.run_dir / "logs"
        self.redis_argv: list[str] = []  # set when we run redis-server ourselves
        self._redis_restarts: list[float] = []  # monotonic times
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def _spawn(self, name: str, argv: list[str]) -> None:
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
            }
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()),
            )

    def start(self, timeout_s: float = 60.0) -> None:
        """Start everything and wait until the controller is ready and every worker registered."""
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.redis_url:
            self._start_redis(timeout_s)
        py = sys.executable
        # jobs may train on files under {run_dir}/data and checkpoint under {run_dir}/checkpoints
        data, ckpt = self.cfg.run_dir / "data", self.cfg.run_dir / "checkpoints"
        data.mkdir(exist_ok=True)
        self._spawn(
            "controller",
            [
                py,
                "-m",
                "controller",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.cfg.port),
                "--redis-url",
                self.controller_redis_url,
                "--auth-file",
                str(self.secrets.auth_file),
                "--data-root",
                str(data),
                "--checkpoint-root-allow",
                str(ckpt),
            ],
        )
        for i in range(self.cfg.workers):
            argv = [
                py,
                "-m",
                "worker",
                "--controller",
                self.url,
                "--join-token-file",
                str(self.secrets.join_token_file),
                "--id",
                f"w{i}",
                "--address",
                "127.0.0.1",
                "--run-dir",
                str(self.cfg.run_dir / "workers" / f"w{i}"),
                "--warm",
                str(self.cfg.warm),
                "--metrics-port",
                "0",
                "--checkpoint-root",
                str(ckpt),
                "--data-root",
                str(data),
            ]  # one for all ranks
            self._spawn(f"worker-w{i}", argv)
        self._wait_ready(timeout_s)

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
                "mk:", self.secrets.redis_admin_password, self.secrets.redis_controller_password
            ).rstrip(),
        )
        self.redis_argv = redis_argv(exe, port, data)
        self._spawn("redis", self.redis_argv)
        base = f"redis://127.0.0.1:{port}/0"
        self.redis_url = with_credentials(base, "admin", self.secrets.redis_admin_password)
        self.controller_redis_url = with_credentials(
            base, "controller", self.secrets.redis_controller_password
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
        """Restart our redis-server if it exited; raise if any other process of the stack exited."""
        redis_proc = self.procs.get("redis")
        if redis_proc is not None and self.redis_argv and redis_proc.poll() is not None:
            self._restart_redis(redis_proc.returncode)
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise StackError(
                    f"{name} exited with code {p.returncode}; see {self.logs / name}.log"
                )

    def _restart_redis(self, code: int | None) -> None:
        """Same port, same AOF directory: jobs, workers and the checkpoint pointers come back
        from the AOF; the controller and the agents reconnect by themselves."""
        now = time.monotonic()
        self._redis_restarts = [t for t in self._redis_restarts if now - t < REDIS_RESTART_WINDOW_S]
        if len(self._redis_restarts) >= REDIS_RESTARTS:
            raise StackError(
                f"redis-server exited {len(self._redis_restarts) + 1} times within "
                f"{REDIS_RESTART_WINDOW_S:.0f}s (last code {code}); see {self.logs / 'redis.log'}"
            )
        self._redis_restarts.append(now)
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
