"""The Redis contract (docs/architecture.md, "Redis keys"): keys under a prefix, and every
operation on them.

Rules this module keeps:
- liveness uses Redis server TIME (inside Lua), never a local clock, so hosts may skew;
- writes a generation or the controller lease guards are Lua scripts (atomic check-and-set);
- nested values are JSON strings inside hashes;
- connection errors surface as `redis.RedisError`; callers retry with a backoff (tenacity).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from services import registration, scripts
from services.progress import ProgressMirror
from services.redis_url import connect, replica_clients, without_user

log = logging.getLogger("meshkeeper.store")

EVENTS_MAXLEN = 1000
LOGS_MAXLEN = 20_000  # lines of trainer output kept per job (`add_log_lines`)
HSET_CHUNK = 500  # Lua's unpack() is bounded; big assignments are written in chunks


class Fenced(RuntimeError):
    """A guarded write was refused: the caller no longer holds the lease."""


class TxRefused(RuntimeError):
    """A fenced transaction failed its checks in Redis (an undeclared key, a key of the wrong
    type, a malformed command); nothing of it was written."""


@dataclass(frozen=True)
class Keys:
    prefix: str = "mk:"

    def worker(self, wid: str) -> str:
        return f"{self.prefix}worker:{wid}"

    def worker_progress(self, wid: str) -> str:
        return f"{self.prefix}worker:{wid}:progress"

    def worker_assignment(self, wid: str) -> str:
        """Controller-written pointer (job, role); also the agent's pub/sub channel."""
        return f"{self.prefix}worker:{wid}:assignment"

    def workers_seen(self) -> str:
        return f"{self.prefix}workers:seen"

    def workers_joined(self) -> str:
        """zset: worker -> its registration's `joined_at` (`Store.registrations`)."""
        return f"{self.prefix}workers:joined"

    def workers_reported(self) -> str:
        """zset: worker -> server time of its last progress report (services/progress.py)."""
        return f"{self.prefix}workers:reported"

    # A job's keys share the hash tag {jid}: Redis Cluster puts them in one slot.
    def job(self, jid: str) -> str:
        return f"{self.prefix}job:{{{jid}}}"

    def job_assignment(self, jid: str) -> str:
        """The job's current generation; also a pub/sub channel, published on at each new
        generation, which its agents follow (the pointers change only with a role)."""
        return f"{self.job(jid)}:assignment"

    def job_checkpoint(self, jid: str) -> str:
        return f"{self.job(jid)}:checkpoint"

    def job_events(self, jid: str) -> str:
        return f"{self.job(jid)}:events"

    def job_logs(self, jid: str) -> str:
        """stream of the job's trainers' output lines (`rank`, `generation`, `line`)."""
        return f"{self.job(jid)}:logs"

    def jobs(self) -> str:
        """zset of every job, scored by submission sequence."""
        return f"{self.prefix}jobs"

    def jobs_open(self) -> str:
        """zset of jobs not yet terminal, scored like `jobs` (the scheduler's queue)."""
        return f"{self.prefix}jobs:open"

    def jobs_finished(self) -> str:
        """zset of terminal jobs, scored by when they ended (server time): retention's queue
        (controller/retention.py)."""
        return f"{self.prefix}jobs:finished"

    def workers_gone(self) -> str:
        """zset of workers that deregistered (left `workers:seen`), scored by when."""
        return f"{self.prefix}workers:gone"

    def worker_keys(self, wid: str) -> list[str]:
        """Every key of worker `wid` (forgotten together by retention)."""
        w = self.worker(wid)
        return [w, f"{w}:progress", f"{w}:assignment", f"{w}:health", f"{w}:probe"]

    def job_keys(self, jid: str) -> list[str]:
        """Every key of job `jid` (archived and deleted together by retention)."""
        j = self.job(jid)
        return [
            j,
            f"{j}:assignment",
            f"{j}:checkpoint",
            f"{j}:events",
            f"{j}:history",
            f"{j}:logs",
        ]

    def idempotency(self, owner: str, key: str) -> str:
        """The job id an owner's Idempotency-Key names (controller/jobs.py `submit`)."""
        return f"{self.prefix}idempotency:{owner}:{key}"

    def jobs_seq(self) -> str:
        return f"{self.prefix}jobs:seq"

    def lease(self) -> str:
        return f"{self.prefix}controller:lease"

    def lease_token(self) -> str:
        return f"{self.prefix}controller:lease:token"

    def controller_wake(self) -> str:
        """pub/sub channel: an agent announces a trainer's exit, the leader's pass runs now."""
        return f"{self.prefix}controller:wake"


def _s(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(",", ":"))
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def flat(mapping: dict[str, Any]) -> dict[str, str]:
    """A dict made fit for HSET: nested values as JSON, None dropped."""
    return {k: _s(v) for k, v in mapping.items() if v is not None}


@dataclass
class Tx:
    """Commands the lease holder wants applied atomically (see `Store.commit`). Every key a
    command touches is declared, in `keys`, so the script can check them all before writing
    and Redis (Cluster included) knows every key of the script up front."""

    cmds: list[list[str]] = field(default_factory=list)
    keys: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    # Workers new to a job: their agent's Redis user is granted the job's checkpoint pointer
    # and streams before the commit (so the agent can commit from its first step); and
    # workers released (worker -> the job it leaves): each is granted what its pointer names
    # after the commit. Only these: Redis rebuilds a changed user's ACL description on the
    # next ACL LIST or SAVE, about 0.35 ms each with the server blocked
    assigned: dict[str, str] = field(default_factory=dict)
    released: dict[str, str] = field(default_factory=dict)

    def _add(self, cmd: list[str], *keys: str) -> Tx:
        self.keys.update(dict.fromkeys(keys))
        self.cmds.append(cmd)
        return self

    def hset(self, key: str, mapping: dict[str, Any]) -> Tx:
        items = [x for kv in flat(mapping).items() for x in kv]
        for i in range(0, len(items), 2 * HSET_CHUNK):
            self._add(["HSET", key, *items[i : i + 2 * HSET_CHUNK]], key)
        return self

    def delete(self, *keys: str) -> Tx:
        return self._add(["DEL", *keys], *keys)

    def hdel(self, key: str, *fields: str) -> Tx:
        return self._add(["HDEL", key, *fields], key) if fields else self

    def delete_if(self, key: str, field_: str, value: str) -> Tx:
        """Delete hash `key` only if its `field_` still equals `value`."""
        return self._add(["DELIFEQ", key, field_, value], key)

    def zrem(self, key: str, member: str) -> Tx:
        return self._add(["ZREM", key, member], key)

    def zadd(self, key: str, member: str, score: float) -> Tx:
        return self._add(["ZADD", key, repr(float(score)), member], key)

    def publish(self, channel: str, message: str) -> Tx:
        return self._add(["PUBLISH", channel, message])  # a channel is not a key

    def xadd(self, stream: str, fields: dict[str, Any], maxlen: int) -> Tx:
        """XADD, trimmed to about `maxlen` entries (the script adds MAXLEN ~ and the id)."""
        items = [x for kv in flat(fields).items() for x in kv]
        return self._add(["XADD", stream, str(maxlen), *items], stream)

    def event(self, stream: str, fields: dict[str, Any]) -> Tx:
        """A job event, the stream trimmed to about EVENTS_MAXLEN entries."""
        return self.xadd(stream, fields, EVENTS_MAXLEN)


@dataclass(frozen=True)
class Beat:
    """One heartbeat's answer: server time, the job the controller's pointer names for this
    worker and that job's current generation, at that instant."""

    time: float
    job: str
    generation: int


def heartbeat_args(keys: Keys, wid: str, job: str, generation: int) -> list:
    """HEARTBEAT's ARGV (services/scripts.py): what the worker serves, and where it reads
    its pointer and the generation of the job the pointer names."""
    return [wid, job, generation, keys.worker_assignment(wid), keys.job_assignment("%s")]


# Redis ACL users (docs/security.md). The `default` user is off; `admin` is for operators and
# tests, `controller` for the controller, and each joined worker has `agent-{wid}`, which the
# controller creates at join and narrows to its job's pointer with each assignment. Ids and
# prefixes go into ACL key patterns, so they may not hold glob characters (* ? [ ] \): a
# worker id "w*" would otherwise own every worker's keys.
WORKER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PREFIX_RE = re.compile(r"^[A-Za-z0-9:._-]{0,32}$")
# A job id (controller/jobs.py `new_job_id`), also in the pointer pattern an agent is granted
JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,78}[a-z0-9])?$")


def agent_user(wid: str) -> str:
    return f"agent-{wid}"


def acl_password(password: str) -> str:
    """The ACL rule that sets `password` by its sha256 (Redis keeps only the hash)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def controller_acl(prefix: str) -> list[str]:
    """The reconcile loop's rules: every key and channel under the prefix, and the server's
    uptime; no server-wide or user-managing command (ACL, CONFIG, CLIENT KILL, DEBUG,
    SHUTDOWN, MODULE, KEYS, FLUSHALL: @dangerous), and no killing or replacing of the
    scripts agents run. Its password alone cannot make a Redis user: that is the
    provisioner's (`provisioner_acl`)."""
    return [
        f"~{prefix}*",
        f"&{prefix}*",
        "+@all",
        "-@dangerous",
        "+info",
        "-script|kill",
        "-script|flush",
        "-function",
    ]


def provisioner_acl() -> list[str]:
    """The agent provisioner's rules: create, narrow, copy and delete agent users (ACL), and
    cut an old agent's connections at a rejoin (CLIENT KILL); no key, no channel. Held by
    the controller process apart from its reconcile loop's user (`Store(provisioner_url=)`),
    so a leaked controller password cannot make a Redis user; this one can, as any
    user-managing credential can, and is kept as the admin's is."""
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        *("+ping", "+hello", "+auth"),
        *("+acl|setuser", "+acl|deluser", "+acl|getuser", "+acl|save", "+acl|list"),
        "+client|kill",
    ]


def agent_acl(prefix: str, wid: str, job: str | None = None, left: str | None = None) -> list[str]:
    """An agent's rules (Redis 7 selectors) while it is assigned to `job` (None: to none;
    `left`: the job it was released from last, whose streams it may still append to):
    each command only on the keys it is for. The root grants the commands without keys and
    the scripts (EVALSHA needs every key it declares in one rule); Redis checks each command a
    script runs against the user again, so HEARTBEAT, REPORT and CHECKPOINT_CAS work through
    the selectors:
    - its own keys (registration, progress, probe result, metrics endpoint): read and write;
    - what the controller writes for it and the job keys: read only; every job's assignment
      channel: subscribe only;
    - the shared sorted sets (`workers:seen`, `workers:reported`, `workers:gone`): ZADD and
      ZREM only, so no agent can SET or DEL them and stop every reconcile pass;
    - the event and log streams of `job` (or, idle, of the job it `left`: the trainers it
      stops after a release are still that job's news): XADD only, so no agent can replace a
      stream with a string, nor write into a job it does not work for;
    - the checkpoint pointer of `job` alone: what the commit CAS runs. A script runs as its
      caller, so the CAS's HSET is one the agent could send by itself; the grant keeps such
      a write to the job the agent works for (the controller moves it with each assignment,
      `Store.grant_job`), and an agent holding no job writes no pointer at all."""
    if not WORKER_ID_RE.fullmatch(wid) or not PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"worker id {wid!r} / prefix {prefix!r} not allowed in an ACL pattern")
    for j in (job, left):
        if j is not None and not JOB_ID_RE.fullmatch(j):
            raise ValueError(f"job id {j!r} not allowed in an ACL pattern")
    me = f"{prefix}worker:{wid}"
    shared = [f"{prefix}workers:seen", f"{prefix}workers:reported", f"{prefix}workers:gone"]
    keys = Keys(prefix)
    checkpoints = [keys.job_checkpoint(job)] if job is not None else []
    news = job if job is not None else left
    streams = [keys.job_events(news), keys.job_logs(news)] if news is not None else []
    return [
        "resetkeys",
        "resetchannels",
        "clearselectors",
        "-@all",
        *("+ping", "+time", "+hello", "+auth", "+multi", "+exec", "+discard"),
        "+wait",  # a checkpoint commit waits for replicas under Sentinel (Store._durable)
        *("+subscribe", "+unsubscribe", "+publish"),  # the channel rules below
        *("+evalsha", "+eval", "+script|load"),
        # the keys the scripts declare (HEARTBEAT, REPORT, CHECKPOINT_CAS), for EVALSHA alone
        *(f"%RW~{k}" for k in (me, f"{me}:progress", *shared[:2], *checkpoints)),
        f"&{me}:assignment",
        f"&{prefix}controller:wake",
        selector(
            [me, f"{me}:progress", f"{me}:probe", f"{me}:metrics"],
            "RW",
            ["+hset", "+hget", "+hgetall", "+hmget", "+del", "+set"],
        ),
        selector(
            [f"{me}:assignment", f"{me}:health", f"{prefix}job:*"],
            "R",
            ["+hget", "+hgetall", "+hmget"],
        ),
        selector(shared, "RW", ["+zadd", "+zrem"]),
        # every job's assignment channel, to learn of a new generation: listening only, so
        # no agent can wake a whole job's agents into re-reading (what it hears, that an
        # assignment changed, the job keys it may read tell it anyway)
        f"(&{keys.job_assignment('*')} +subscribe +unsubscribe)",
        *([selector(streams, "W", ["+xadd"])] if streams else []),
        *([selector(checkpoints, "RW", ["+hget", "+hmget", "+hset"])] if checkpoints else []),
    ]


def selector(keys: list[str], access: str, commands: list[str]) -> str:
    """One ACL selector: `commands` on `keys` only, with `access` (R, W or RW)."""
    return "(" + " ".join([*(f"%{access}~{k}" for k in keys), *commands]) + ")"


def acl_file(
    prefix: str,
    admin_password: str,
    controller_password: str,
    provisioner_password: str,
    replication_password: str | None = None,
) -> str:
    """The users file (redis-server --aclfile) of a fresh Redis: default off, admin,
    controller and provisioner. Agent users are added at runtime and kept by ACL SAVE. With
    `replication_password` (a Sentinel deployment, every data node gets the same file), also
    `replica` (what a replica authenticates to its master as: --masteruser) and `sentinel`
    (the Sentinels' user on the data nodes: sentinel auth-user), each with only the commands
    Redis documents for the role."""
    # `default` is off: no connection can authenticate as it. It keeps every permission all
    # the same: with `default` at -@all, redis-server 7.0.15 restarted under `meshkeeper up`
    # refused MULTI/EXEC blocks while replaying its AOF ("NOPERM ACLs rules changed between
    # the moment the transaction was accumulated and the EXEC call"), and a running job
    # vanished; with full permissions no ACL can refuse the replay.
    users = [
        "user default off ~* &* +@all",
        f"user admin on {acl_password(admin_password)} ~* &* +@all",
        f"user controller on {acl_password(controller_password)} "
        + " ".join(controller_acl(prefix)),
        f"user provisioner on {acl_password(provisioner_password)} " + " ".join(provisioner_acl()),
    ]
    if replication_password:
        pw = acl_password(replication_password)
        users += [
            f"user replica on {pw} +psync +replconf +ping",
            f"user sentinel on {pw} &* +multi +slaveof +ping +exec +subscribe +config|rewrite "
            "+role +publish +info +client|setname +client|kill +script|kill",
        ]
    return "\n".join(users) + "\n"


def loads(value: str | None, default: Any = None) -> Any:
    if not value:
        return default
    try:
        return json.loads(value)
    except ValueError:
        return default


NO_PROVISIONER = (
    "this controller holds no provisioner credential, so no agent can join: give it "
    "REDIS_PROVISIONER_URL (or --redis-provisioner-url-file), the Redis user that manages "
    "agent users (docs/security.md)"
)


class NoProvisioner(RuntimeError):
    """Agent users were to be managed by a store that holds no provisioner credential."""


class Store:
    """One Redis connection pool plus the contract's operations. Thread-safe."""

    # How long one call may block when Redis stalls or cannot be reached, before it raises
    # RedisError and the caller's own loop backs off and logs it (docs/architecture.md,
    # "Failure handling"):
    #   worst case = (retries + 1) x (connect_timeout + socket_timeout)
    #                + retries x backoff (<= 0.5 s)
    # A frozen redis-server still accepts connections (the kernel does), so a stall costs the
    # socket timeouts only: with these defaults 2 x 2.0 s + ~0.1 s, about 4 s (it was 3 x 5 s).
    # That is a bound for the controller and the agent's main loop, whose calls wait out short
    # blips; the controller judges no silence after such a gap (controller/availability.py).
    # The heartbeat, which has to reach Redis within dead_after_s (2 s by default), uses its
    # own tighter bound (worker/heartbeat.py).
    def __init__(
        self,
        url: str,
        prefix: str = "mk:",
        *,
        socket_timeout: float = 2.0,
        connect_timeout: float = 1.0,
        retries: int = 1,
        replica_recheck_s: float = 10.0,
        mirror_progress: bool = False,
        credentials: redis.CredentialProvider | None = None,
        provisioner_url: str | None = None,
        provisions: bool = True,
    ):
        """`replica_recheck_s`: under Sentinel, how long writes stop waiting for replicas
        after a WAIT fell short (`_replicated`). `mirror_progress`: `progress` re-reads only
        the reports rewritten since its last call (the controller's reads; an agent's ACL
        user may not read the index it needs). `credentials`: who to authenticate as, asked
        at every (re)connect, instead of the URL's user and password (an agent's, replaced
        when it joins again: worker/agent/joining.py). Agent users (ACL commands) are managed
        through `provisioner_url`'s user when given (the controller: `provisioner_acl`), else
        through this connection (an admin's: tools and tests); `provisions=False`: by nobody
        (a controller given no provisioner: agents cannot join, `NoProvisioner`)."""
        self.credentials = credentials
        self.url = without_user(url) if credentials else url
        self.keys = Keys(prefix)
        self._options = dict(
            decode_responses=True,
            socket_connect_timeout=connect_timeout,
            socket_timeout=socket_timeout,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            health_check_interval=5,
            **({"credential_provider": credentials} if credentials else {}),
        )
        # `sentinel`: a Sentinel-monitored master (services/redis_url.py), None for one server
        self.r, self.sentinel = connect(self.url, **self._options)
        self._acl: redis.Redis | None = None
        self._acl_sentinel = None  # the provisioner's Sentinel target: its replicas' users
        if provisions and provisioner_url:
            self._acl, self._acl_sentinel = connect(provisioner_url, **self._options)
        elif provisions:
            self._acl, self._acl_sentinel = self.r, self.sentinel
        self._replica_recheck_s = replica_recheck_s
        self._replicas_short_until = 0.0  # time.monotonic(); see `_replicated`
        self._acl_lock = threading.Lock()
        self._create_job = self.r.register_script(scripts.CREATE_JOB)
        self._heartbeat = self.r.register_script(scripts.HEARTBEAT)
        self._fenced = self.r.register_script(scripts.FENCED_EXEC)
        self._lease = self.r.register_script(scripts.LEASE_ACQUIRE)
        self._release = self.r.register_script(scripts.LEASE_RELEASE)
        self._checkpoint = self.r.register_script(scripts.CHECKPOINT_CAS)
        self._report = self.r.register_script(scripts.REPORT)
        self._mirror = (
            ProgressMirror(self.r, self.keys.workers_reported(), self.keys.worker_progress)
            if mirror_progress
            else None
        )
        # poisoned state met and survived, by kind (meshkeeper_state_errors_total), and what
        # was already reported (a malformed hash is read again every pass)
        self.state_errors: Counter[str] = Counter()
        self._reported_errors: set[tuple] = set()
        # wid -> (joined_at, its registration hash): `registrations`
        self._registrations: dict[str, tuple[float, dict[str, str]]] = {}
        self._registrations_lock = threading.Lock()

    def close(self) -> None:
        self.r.close()
        if self._acl is not None and self._acl is not self.r:
            self._acl.close()

    @property
    def provisions(self) -> bool:
        """Whether this store may manage agent users (see `__init__`)."""
        return self._acl is not None

    def _users(self) -> redis.Redis:
        if self._acl is None:
            raise NoProvisioner(NO_PROVISIONER)
        return self._acl

    def ping(self) -> bool:
        return bool(self.r.ping())

    def now(self) -> float:
        """Redis server time in seconds: the one clock every part agrees on."""
        s, us = self.r.time()
        return s + us / 1e6

    def uptime_s(self) -> int:
        """Seconds since the Redis server started: heartbeats are meaningful only after the
        server has been up for a full dead-after interval (a restart stalls every writer)."""
        return int(self.r.info("server")["uptime_in_seconds"])

    # -- workers (agent side) ---------------------------------------------------------
    def register_worker(self, wid: str, info: dict[str, Any]) -> None:
        k = self.keys.worker(wid)
        pipe = self.r.pipeline()
        pipe.delete(k)
        pipe.hset(k, mapping=flat(info))
        if "joined_at" in info:
            pipe.zadd(self.keys.workers_joined(), {wid: info["joined_at"]})
        pipe.execute()

    def set_worker(self, wid: str, fields: dict[str, Any]) -> None:
        self.r.hset(self.keys.worker(wid), mapping=flat(fields))

    def heartbeat(self, wid: str, job: str = "", generation: int = 0) -> Beat:
        """Stamp `workers:seen` with server time; returns that time, the job the worker's
        pointer names and that job's current generation."""
        t, pjob, pgen = self._heartbeat(
            keys=[self.keys.workers_seen(), self.keys.worker(wid)],
            args=heartbeat_args(self.keys, wid, job, generation),
        )
        return Beat(float(t), pjob, int(pgen or 0))

    def join_worker(self, wid: str, info: dict[str, Any], password: str) -> bool:
        """The controller's side of a join: (re)create the agent's ACL user with `password`,
        drop connections of an earlier incarnation (they were authenticated with the old
        password), and write the registration with a controller-set `joined_at`. Returns
        whether the user was saved to Redis's aclfile (False: Redis has none, and agent users
        last until it restarts)."""
        user = agent_user(wid)
        users = self._users()
        job = self.r.hget(self.keys.worker_assignment(wid), "job")  # a rejoin mid-job
        users.execute_command(
            "ACL",
            "SETUSER",
            user,
            "reset",
            "on",
            acl_password(password),
            *agent_acl(self.keys.prefix, wid, job),
        )
        users.execute_command("CLIENT", "KILL", "USER", user)
        now = self.now()
        pipe = self.r.pipeline()
        pipe.delete(self.keys.worker(wid))
        pipe.hset(self.keys.worker(wid), mapping=flat({**info, "joined_at": now}))
        pipe.zadd(self.keys.workers_joined(), {wid: now})
        pipe.execute()
        return self.save_acl()

    def grant_jobs(self, jobs: dict[str, str | None], left: dict[str, str] | None = None) -> None:
        """Give each worker's agent user the checkpoint pointer and streams of its job (None:
        no pointer, and the streams of the job in `left`, if any; `agent_acl`), then save and
        copy the users as a join does. Workers without an agent user (never joined, or Redis
        lost its users) are skipped: a join grants them; and all of them without a provisioner,
        whose agents cannot have joined."""
        if self._acl is None:
            return
        users = {line.split(" ", 2)[1] for line in self._acl.execute_command("ACL", "LIST")}
        pipe = self._acl.pipeline(transaction=False)  # two round trips for a job of any size
        for wid, job in sorted(jobs.items()):
            if agent_user(wid) in users:
                rules = agent_acl(self.keys.prefix, wid, job, (left or {}).get(wid))
                pipe.execute_command("ACL", "SETUSER", agent_user(wid), *rules)
        pipe.execute()
        self.save_acl()

    def reconcile_grants(self) -> list[str]:
        """Correct every agent user whose checkpoint grant differs from the job its pointer
        names, and answer those workers. Grants move around commits (`commit`), so a
        controller that died between a release and the grant's removal, or a grant made for
        an assignment that was then refused, leaves one; the leader runs this when it takes
        the lease and every ACL_GRANTS_S after."""
        if self._acl is None:
            return []
        users = acl_rules(self._acl.execute_command("ACL", "LIST"))
        prefix = "agent-"
        granted = {
            name[len(prefix) :]: _granted_job(rules, self.keys)
            for name, rules in users.items()
            if name.startswith(prefix)
        }
        assigned = self._assigned_jobs(granted)
        stale = sorted(w for w, job in assigned.items() if granted[w] != job)
        if stale:  # a worker taken off a job keeps that job's streams, as a release does
            left = {w: granted[w] for w in stale if granted[w] is not None}
            self.grant_jobs({w: assigned[w] for w in stale}, left)
        return stale

    def _assigned_jobs(self, wids: Iterable[str]) -> dict[str, str | None]:
        """The job each worker's assignment pointer names now (None: none)."""
        pipe = self.r.pipeline(transaction=False)
        for wid in sorted(wids):
            pipe.hget(self.keys.worker_assignment(wid), "job")
        return dict(zip(sorted(wids), pipe.execute(), strict=True))

    def held_elsewhere(self, wid: str, credential: str | None, hold_s: float) -> float | None:
        """Seconds since worker `wid`'s last beat while a live agent holds it (a beat within
        `hold_s`) and `credential` is not its Redis user's current password; None when a join
        with this id may go ahead: nobody beats for it, or the caller is its own agent again
        (docs/security.md, "Joining"). An id whose Redis user is gone (Redis lost its users)
        is free too: no agent can beat as it any more. The beat is read from the worker's own
        hash, which only its agent (the heartbeat script) and the controller write: any agent
        may ZREM a member of `workers:seen`, and would otherwise free a live id for itself."""
        pipe = self.r.pipeline(transaction=False)
        pipe.time()
        pipe.hmget(self.keys.worker(wid), ["beat", "state"])
        (s, us), (beat, state) = pipe.execute()
        now = s + us / 1e6
        if beat is None or state == "stopped" or now - float(beat) > hold_s:
            return None
        user = self._users().acl_getuser(agent_user(wid))
        if user is None:
            return None
        presented = hashlib.sha256((credential or "").encode()).hexdigest()
        if credential and any(hmac.compare_digest(presented, h) for h in user["passwords"]):
            return None
        return now - float(beat)

    def delete_user(self, user: str) -> None:
        """ACL DELUSER on the master and on every replica the Sentinels know (a copy never
        deletes: `sync_acl`); the caller saves the master's aclfile once after a batch."""
        self._users().execute_command("ACL", "DELUSER", user)
        self._on_replicas(lambda replica: replica.execute_command("ACL", "DELUSER", user))

    def save_acl(self) -> bool:
        """ACL SAVE, after copying the master's users to every replica the Sentinels know (ACL
        changes are not replicated, and a promoted replica must know every agent): whether
        the master has an aclfile that now holds its users (False: it has none, and agent
        users last until it restarts)."""
        self.sync_acl()
        try:
            self._users().execute_command("ACL", "SAVE")
        except redis.ResponseError:  # "not configured to use an ACL file"
            return False
        return True

    def sync_acl(self) -> int:
        """Give every replica the master's ACL users (each replica's aclfile saved too); the
        number of users written. It only adds and updates: two copies racing (two joins at
        once) could otherwise delete from a replica a user the older snapshot lacked. One
        copy at a time per process; the controller also runs it periodically, for a replica
        that was away (docs/architecture.md, "Redis high availability")."""
        if self._acl is None or self._acl_sentinel is None:
            return 0
        with self._acl_lock:
            want = acl_rules(self._acl.execute_command("ACL", "LIST"))

            def copy(replica: redis.Redis) -> int:
                have = acl_rules(replica.execute_command("ACL", "LIST"))
                stale = [u for u, rules in want.items() if not same_rules(have.get(u), rules)]
                for user in stale:
                    replica.execute_command("ACL", "SETUSER", user, "reset", *want[user])
                return len(stale)

            return sum(self._on_replicas(copy))

    def _on_replicas(self, do: Callable[[redis.Redis], Any]) -> list[Any]:
        """`do(replica)` (how many users it changed) on each replica the Sentinels know (none
        without Sentinel), then ACL SAVE there if it changed any. A replica that fails is
        skipped with a warning: the periodic copy brings it up to date later."""
        if self._acl_sentinel is None:
            return []
        done = []
        for replica in replica_clients(self._acl_sentinel, **self._options):
            try:
                done.append(n := do(replica))
                if n:  # users written or deleted
                    replica.execute_command("ACL", "SAVE")
            except redis.RedisError as e:
                log.warning("cannot change ACL users on a Redis replica (%s); retrying later", e)
            finally:
                replica.close()
        return done

    def deregister_worker(self, wid: str) -> None:
        pipe = self.r.pipeline()
        pipe.zrem(self.keys.workers_seen(), wid)
        pipe.zadd(self.keys.workers_gone(), {wid: self.now()})
        pipe.hset(self.keys.worker(wid), "state", "stopped")
        pipe.execute()

    def worker_assignment(self, wid: str) -> dict[str, str]:
        """The worker's pointer (`job`, `role`, `drain_step`) with `generation`: the current
        one of the job it names, read after it (a pointer changes only when the worker's job
        or role does)."""
        pointer = self.r.hgetall(self.keys.worker_assignment(wid))
        if pointer.get("job"):
            gen = self.r.hget(self.keys.job_assignment(pointer["job"]), "generation")
            pointer["generation"] = gen or "0"
        return pointer

    def write_progress(self, wid: str, progress: dict[str, Any]) -> None:
        """Rewrite the worker's progress hash and stamp it in `workers:reported` (REPORT)."""
        pairs = [x for kv in flat(progress).items() for x in kv]
        self._report(
            keys=[self.keys.worker_progress(wid), self.keys.workers_reported()], args=[wid, *pairs]
        )

    def announce_exit(self, wid: str) -> None:
        """Wake the leading controller's pass: a trainer of `wid` exited (its report is
        written). The message carries nothing a pass trusts; it only runs the pass early."""
        self.r.publish(self.keys.controller_wake(), wid)

    def commit_checkpoint(
        self, jid: str, generation: int, step: int, path: str, keep: int = 1_000_000, *, wid: str
    ) -> list[dict] | None:
        """Move the checkpoint pointer, only within the job's current generation and forward,
        and only for worker `wid` while its pointer names that job.
        None when refused; else the history entries that fell out of the newest `keep`, which
        no pointer references any more (the only checkpoints anyone may delete)."""
        dropped = self._durable(
            self._checkpoint,
            [self.keys.job_checkpoint(jid)],
            [
                generation,
                step,
                path,
                max(1, keep),
                jid,
                self.keys.job(jid),
                self.keys.worker_assignment(wid),
            ],
        )
        return None if dropped is None else loads(dropped, [])

    def checkpoint_history(self, jid: str) -> list[dict]:
        """The committed pointers a restore may use, newest first ({step, generation, path})."""
        return loads(self.r.hget(self.keys.job_checkpoint(jid), "history"), [])

    # -- workers (controller side) ----------------------------------------------------
    def workers_seen(self) -> dict[str, float]:
        """Every worker ever seen -> its last heartbeat (server time)."""
        return dict(self.r.zrange(self.keys.workers_seen(), 0, -1, withscores=True))

    def alive_workers(self, within_s: float, now: float | None = None) -> list[str]:
        """The workers that beat within `within_s` of `now` (server time by default)."""
        now = self.now() if now is None else now
        return self.r.zrangebyscore(self.keys.workers_seen(), now - within_s, "+inf")

    def beats(self, wids: list[str]) -> tuple[float, dict[str, float]]:
        """Server time, and the last heartbeat of each of `wids` that has one, in one round
        trip. The time is read first, so no worker's silence is longer than its beat says.
        O(len(wids)) however big the pool is."""
        if not wids:  # ZMSCORE needs a member
            return self.now(), {}
        pipe = self.r.pipeline(transaction=False)
        pipe.time()
        pipe.zmscore(self.keys.workers_seen(), wids)
        (s, us), scores = pipe.execute()
        return s + us / 1e6, {w: t for w, t in zip(wids, scores, strict=True) if t is not None}

    def last_seen(self, wids: list[str]) -> dict[str, float]:
        """Last heartbeat (server time) of each of `wids` that has one."""
        return self.beats(wids)[1] if wids else {}

    def alive_among(self, wids: list[str], within_s: float) -> set[str]:
        """Which of `wids` heartbeat within `within_s` of server time."""
        if not wids:
            return set()
        now, seen = self.beats(wids)
        return {w for w, t in seen.items() if now - t <= within_s}

    def _hashes(self, ids: list[str], key_of: Callable[[str], str]) -> dict[str, dict[str, str]]:
        """id -> the hash at `key_of(id)`, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(key_of(i))
        return dict(zip(ids, pipe.execute(), strict=True))

    def workers(self, wids: list[str]) -> dict[str, dict[str, str]]:
        """Registration hashes; one with a malformed typed field comes back without that field
        and without `joined_at`, so the worker is never placed until it joins again."""
        return {w: self._usable(w, h) for w, h in self._hashes(wids, self.keys.worker).items()}

    def _usable(self, wid: str, fields: dict[str, str]) -> dict[str, str]:
        bad = registration.problems(fields)
        if not bad:
            return fields
        seen = (wid, tuple(sorted((k, fields[k]) for k in bad)))
        if seen not in self._reported_errors:  # once per distinct bad value, not every pass
            self._reported_errors.add(seen)
            self.state_errors["registration"] += 1
            log.warning(
                "worker %s: its registration %s is malformed (%s); the worker is not placed "
                "until it joins again",
                wid,
                self.keys.worker(wid),
                "; ".join(f"{k}={fields[k][:40]!r}: {why}" for k, why in bad.items()),
            )
        return {k: v for k, v in fields.items() if k not in bad and k != "joined_at"}

    def registrations(self, wids: list[str]) -> dict[str, dict[str, str]]:
        """The registration hashes of those of `wids` that joined, as written at their join:
        read once per (worker, `joined_at`) and kept, so the fields an agent rewrites later
        (`state`, `pid`, the last beat's) are stale here; use `workers` for those. A join
        writes the hash and `workers:joined` in one transaction, and a new join has a new
        `joined_at`: one ZMSCORE tells which kept ones are still current."""
        if not wids:
            return {}
        joined = dict(zip(wids, self.r.zmscore(self.keys.workers_joined(), wids), strict=True))
        with self._registrations_lock:
            kept = self._registrations
            stale = [w for w, t in joined.items() if t is not None and kept.get(w, (None,))[0] != t]
            if stale:
                for w, h in self.workers(stale).items():
                    if h.get("joined_at") and float(h["joined_at"]) == joined[w]:
                        kept[w] = (joined[w], h)
            if len(kept) > 2 * len(wids) + 1024:  # forget workers no longer asked about
                self._registrations = kept = {w: kept[w] for w in wids if w in kept}
            return {w: kept[w][1] for w in wids if w in kept and kept[w][0] == joined[w]}

    def progress(self, wids: list[str]) -> dict[str, dict[str, str]]:
        if self._mirror is not None:
            return self._mirror.read(wids)
        return self._hashes(wids, self.keys.worker_progress)

    def assignments(self, wids: list[str]) -> dict[str, dict[str, str]]:
        """The workers' pointers (job, role)."""
        return self._hashes(wids, self.keys.worker_assignment)

    def rendezvous(self, jid: str) -> tuple[str | None, int | None]:
        """The (address, port) of the job's current assignment: two fields, not the hash (a
        16,384-rank job's holds as many entries)."""
        addr, port = self.r.hmget(self.keys.job_assignment(jid), "master_addr", "master_port")
        return addr, int(port) if port else None

    def generations(self, jids: set[str]) -> dict[str, int]:
        """Each job's current generation, as its assignment says (absent: none yet)."""
        pipe = self.r.pipeline(transaction=False)
        order = sorted(jids)
        for jid in order:
            pipe.hget(self.keys.job_assignment(jid), "generation")
        return {j: int(g) for j, g in zip(order, pipe.execute(), strict=True) if g is not None}

    # -- jobs -------------------------------------------------------------------------
    def create_job(self, jid: str, record: dict[str, Any]) -> int:
        """A new job at the back of the queue; returns its sequence number."""
        k = self.keys
        fields = [x for kv in flat(record).items() for x in kv]
        return int(
            self._durable(
                self._create_job,
                [k.jobs_seq(), k.job(jid), k.jobs(), k.jobs_open()],
                [jid, *fields],
            )
        )

    def request_cancel(self, jid: str) -> None:
        """A desired-state flag; the lease holder enacts it."""
        self.r.hset(self.keys.job(jid), "cancel_requested", "1")

    def request_suspend(self, jid: str, suspend: bool) -> None:
        """A desired-state flag (True: suspend, False: resume); the lease holder enacts it."""
        self.r.hset(self.keys.job(jid), "suspend_requested", "1" if suspend else "0")

    def job(self, jid: str) -> dict[str, str]:
        return self.r.hgetall(self.keys.job(jid))

    def jobs(self, jids: list[str]) -> dict[str, dict[str, str]]:
        return self._hashes(jids, self.keys.job)

    def job_ids(self, open_only: bool = False, last: int = 0) -> list[str]:
        """Job ids in submission order; only the newest `last` when given."""
        key = self.keys.jobs_open() if open_only else self.keys.jobs()
        return self.r.zrange(key, -last if last > 0 else 0, -1)

    def finished_job_ids(self) -> list[str]:
        """Terminal jobs still kept (controller/retention.py), in the order they ended."""
        return self.r.zrange(self.keys.jobs_finished(), 0, -1)

    def job_assignment(self, jid: str) -> dict[str, str]:
        return self.r.hgetall(self.keys.job_assignment(jid))

    def checkpoint(self, jid: str) -> dict[str, str]:
        return self.r.hgetall(self.keys.job_checkpoint(jid))

    # -- events -----------------------------------------------------------------------
    def add_event(self, jid: str, fields: dict[str, Any]) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(
            self.keys.job_events(jid),
            flat({"time": self.now(), **fields}),
            maxlen=EVENTS_MAXLEN,
            approximate=True,
        )
        for result in self._replicated(pipe):
            if isinstance(result, Exception):
                raise result

    def add_log_lines(self, jid: str, rows: list[tuple[int, int, str]]) -> None:
        """(generation, rank, line) rows of the job's trainers' output, the stream trimmed to
        about LOGS_MAXLEN lines (a log is for reading what happened, not an archive: the
        rank's own file keeps everything)."""
        pipe = self.r.pipeline(transaction=False)
        for generation, rank, line in rows:
            pipe.xadd(
                self.keys.job_logs(jid),
                {"generation": generation, "rank": rank, "line": line},
                maxlen=LOGS_MAXLEN,
                approximate=True,
            )
        pipe.execute()

    def log_lines(
        self, jid: str, after: str, limit: int, rank: int | None = None, newest: bool = False
    ) -> list[dict[str, Any]]:
        """Up to `limit` lines after stream id `after` (exclusive; '-': from the start), or the
        newest `limit` with `newest`; only rank `rank`'s when given. Oldest first."""
        key, out, cursor = self.keys.job_logs(jid), [], after
        while len(out) < limit:
            if newest:
                rows = self.r.xrevrange(key, max=cursor if cursor != "-" else "+", count=500)
            else:
                start = f"({cursor}" if cursor != "-" else "-"
                rows = self.r.xrange(key, min=start, max="+", count=500)
            for i, f in rows:
                if rank is None or int(f.get("rank", -1)) == rank:
                    out.append(
                        {
                            "id": i,
                            "rank": int(f.get("rank", -1)),
                            "generation": int(f.get("generation", 0)),
                            "line": f.get("line", ""),
                        }
                    )
            if len(rows) < 500:
                break
            cursor = f"({rows[-1][0]}" if newest else rows[-1][0]
        out = out[:limit]
        return out[::-1] if newest else out

    def events(self, jid: str, after: str = "-", limit: int = 100) -> list[dict[str, Any]]:
        start = f"({after}" if after != "-" else "-"
        rows = self.r.xrange(self.keys.job_events(jid), min=start, max="+", count=limit)
        out = []
        for i, f in rows:
            e = {"id": i, **f, "time": float(f.get("time", 0))}
            if "generation" in f:
                e["generation"] = int(f["generation"])
            out.append(e)
        return out

    # -- the controller lease -----------------------------------------------------------
    def acquire_lease(self, holder: str, ttl_s: float) -> str | None:
        """Take or renew the lease; returns 'holder:token' while we hold it, else None."""
        v = self._lease(
            keys=[self.keys.lease(), self.keys.lease_token()], args=[holder, int(ttl_s * 1000)]
        )
        return v or None

    def release_lease(self, lease: str) -> None:
        self._release(keys=[self.keys.lease()], args=[lease])

    def lease_holder(self) -> str | None:
        return self.r.get(self.keys.lease())

    def commit(self, tx: Tx, lease: str) -> None:
        """Apply `tx` all or nothing, only if `lease` is still the current lease (fencing).
        Raises `Fenced` (lease lost) or `TxRefused` (a check failed); either way nothing
        of `tx` was written."""
        if not tx.cmds:
            return
        if tx.assigned:
            self.grant_jobs(tx.assigned)
        try:
            result = self._durable(
                self._fenced, [self.keys.lease(), *tx.keys], [lease, json.dumps(tx.cmds)]
            )
        except redis.ResponseError as e:
            msg = str(e)
            if msg.startswith("FENCED"):
                raise Fenced(f"lease {lease} is no longer held") from None
            if msg.startswith("REFUSED"):
                raise TxRefused(
                    f"fenced transaction refused, nothing written: {msg[len('REFUSED ') :]}"
                ) from None
            raise
        if streams := [k for k in result or [] if isinstance(k, str)]:
            log.warning(
                "events not recorded: %s refused XADD (an id at the stream's end was forged "
                "by a writer); the job's state was written all the same",
                ", ".join(streams),
            )
        if tx.released:
            self.grant_jobs(self._assigned_jobs(tx.released), tx.released)

    def _durable(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """Run `script` and answer once it is replicated (`_replicated`)."""
        if self.sentinel is None or not self.sentinel.wait_replicas:
            return script(keys=keys, args=args)
        for attempt in range(2):
            pipe = self.r.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            (result,) = self._replicated(pipe)
            if attempt == 0 and isinstance(result, redis.exceptions.NoScriptError):
                self.r.script_load(script.script)  # a promoted replica has no script cache
                continue
            break
        if isinstance(result, Exception):
            raise result
        return result

    def _replicated(self, pipe: redis.client.Pipeline) -> list[Any]:
        """Execute the non-transactional `pipe`, its results (errors as values). Under
        Sentinel it answers only once `wait_replicas` replicas have its writes (WAIT, on the
        pipeline's own connection: WAIT covers that connection's writes), so a failover cannot
        drop what was acknowledged. A WAIT that times out is logged, and the writes stand:
        refusing them would not undo them on the master.

        After a WAIT fell short, writes do not wait for `replica_recheck_s`; the first write
        after that waits again and so finds out whether the replicas are back. With its
        replicas stopped or gone, every WAIT runs its whole timeout: a controller pass that
        writes ten times would take ten timeouts, and an agent's loop would stall on every
        checkpoint commit and event. What it gives up: the writes of that window are
        acknowledged with no replica's copy, as a timed-out WAIT's writes already are, and a
        failover inside it can lose them (docs/architecture.md, "Redis high availability")."""
        want = self.sentinel.wait_replicas if self.sentinel is not None else 0
        if want and time.monotonic() < self._replicas_short_until:
            want = 0
        if want:
            pipe.execute_command("WAIT", want, self.sentinel.wait_timeout_ms)
        results = pipe.execute(raise_on_error=False)
        if not want:
            return results
        acked = results.pop()
        if isinstance(acked, Exception) or acked < want:
            self._replicas_short_until = time.monotonic() + self._replica_recheck_s
            log.warning(
                "a write reached %s of %d Redis replicas within %d ms; a failover now could "
                "lose it. Writes do not wait for replicas for the next %.0f s.",
                acked,
                want,
                self.sentinel.wait_timeout_ms,
                self._replica_recheck_s,
            )
        elif self._replicas_short_until:
            self._replicas_short_until = 0.0
            log.warning("Redis replicas acknowledge writes again; writes wait for them again")
        return results


ACL_RULE_RE = re.compile(r"\([^)]*\)|\S+")  # a selector `(...)` is one rule


def acl_rules(listing: list[str]) -> dict[str, list[str]]:
    """ACL LIST lines (`user NAME RULE...`) as {name: rules}."""
    out = {}
    for line in listing:
        _, name, *rules = ACL_RULE_RE.findall(line)
        out[name] = rules
    return out


def _granted_job(rules: list[str], keys: Keys) -> str | None:
    """The job whose checkpoint pointer an agent user's rules grant (`agent_acl`), if any."""
    pointer = re.compile(re.escape(f"~{keys.job_checkpoint('JOB')}").replace("JOB", "(.+)") + "$")
    for rule in rules:
        for word in rule.strip("()").split():
            if m := pointer.match(word.lstrip("%RW")):
                return m.group(1)
    return None


def same_rules(a: list[str] | None, b: list[str]) -> bool:
    """Whether two users' ACL LIST rules grant the same: Redis lists single commands in hash
    order (inside selectors too), and `reset` (how a copy is made) adds sanitize-payload, its
    default."""
    return a is not None and _rule_set(a) == _rule_set(b)


def _rule_set(rules: list[str]) -> set:
    return {
        frozenset(r[1:-1].split()) if r.startswith("(") else r
        for r in rules
        if r != "sanitize-payload"
    }


def wait_for_redis(store: Store, timeout_s: float) -> None:
    """Block until Redis answers (or raise the last error)."""
    Retrying(
        retry=retry_if_exception_type(redis.RedisError),
        stop=stop_after_delay(timeout_s),
        wait=wait_random_exponential(multiplier=0.1, max=2.0),
        reraise=True,
    )(store.ping)
