"""Redis URLs: one server (`redis://`, `rediss://`) or a Sentinel-monitored master
(`redis+sentinel://`, or `rediss+sentinel://` for TLS to the Sentinels and the data nodes
alike), docs/architecture.md "Redis high availability".

    redis+sentinel://USER:PASSWORD@HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]

- USER/PASSWORD authenticate to the data nodes (the master, and the replicas the controller
  copies ACL users to), as in a `redis://` URL.
- HOST:PORT are the Sentinels; SERVICE is the name they monitor the master under.
- OPTIONS: `sentinel_username` and `sentinel_password` (the Sentinels' own user: read-only
  discovery commands are enough), `wait_replicas` (default 1) and `wait_timeout_ms` (default
  1000): a write the service must not lose on a failover (a fenced transaction, a job, a
  checkpoint pointer) is acknowledged only after WAIT says that many replicas have it, or
  the timeout has passed (then it is logged: replication is behind).
- TLS OPTIONS (`rediss+sentinel://` only): `ssl_ca_certs` (the CA that signed the Sentinels'
  and the data nodes' certificates; the system's CAs when left out), and `ssl_certfile` with
  `ssl_keyfile` where the servers demand client certificates. Hostnames are checked: the
  certificates must name the addresses the Sentinels announce.

Redis replicates asynchronously, so without WAIT a failover can drop the last writes the old
master acknowledged: a new assignment, an accepted job, a committed checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEME = "redis+sentinel"
TLS_SENTINEL_SCHEME = "rediss+sentinel"
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
OPTIONS = ("sentinel_username", "sentinel_password", "wait_replicas", "wait_timeout_ms")
SECRET_OPTIONS = {"sentinel_password", "password"}


class RedisURLError(ValueError):
    """A Redis URL that cannot be used; the message names the part and the fix."""


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    sentinel_username: str | None
    sentinel_password: str | None
    wait_replicas: int
    wait_timeout_ms: int
    tls: dict[str, Any]  # redis-py's ssl keyword arguments; empty for plain TCP


def is_sentinel(url: str) -> bool:
    return urlsplit(url).scheme in (SENTINEL_SCHEME, TLS_SENTINEL_SCHEME)


def _hostport(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise RedisURLError(f"Redis Sentinel address {s!r}: write it as HOST:PORT")
    return host.strip("[]"), int(port)


def parse_sentinel(url: str) -> SentinelTarget:
    u = urlsplit(url)
    if not is_sentinel(url):
        raise RedisURLError(
            f"Redis URL scheme {u.scheme!r}: use {SENTINEL_SCHEME}:// (or "
            f"{TLS_SENTINEL_SCHEME}:// for TLS)"
        )
    creds, _, hosts = u.netloc.rpartition("@")
    user, _, password = creds.partition(":")
    parts = [p for p in u.path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise RedisURLError(
            f"Redis URL {without_credentials(url)}: give the monitored master's name as the "
            "path, /SERVICE or /SERVICE/DB (e.g. redis+sentinel://s1:26379,s2:26379/mymaster)"
        )
    options = dict(parse_qsl(u.query))
    tls = u.scheme == TLS_SENTINEL_SCHEME
    unknown = set(options) - {*OPTIONS, *TLS_OPTIONS}
    if unknown:
        raise RedisURLError(
            f"Redis URL option(s) {sorted(unknown)} are not known; use one of "
            f"{', '.join((*OPTIONS, *TLS_OPTIONS))}"
        )
    if not tls and set(options) & set(TLS_OPTIONS):
        raise RedisURLError(
            f"Redis URL option(s) {sorted(set(options) & set(TLS_OPTIONS))} need TLS: write the "
            f"URL as {TLS_SENTINEL_SCHEME}://"
        )
    if ("ssl_certfile" in options) != ("ssl_keyfile" in options):
        raise RedisURLError("Redis URL ssl_certfile and ssl_keyfile go together: give both")
    try:
        wait_replicas = int(options.get("wait_replicas", 1))
        wait_timeout_ms = int(options.get("wait_timeout_ms", 1000))
    except ValueError:
        raise RedisURLError("Redis URL wait_replicas and wait_timeout_ms take integers") from None
    if wait_replicas < 0 or wait_timeout_ms < 1:
        raise RedisURLError(
            "Redis URL wait_replicas must be >= 0 and wait_timeout_ms >= 1 (a WAIT of 0 ms "
            "would block forever)"
        )
    return SentinelTarget(
        sentinels=[_hostport(h) for h in hosts.split(",") if h],
        service=parts[0],
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
        wait_replicas=wait_replicas,
        wait_timeout_ms=wait_timeout_ms,
        tls={"ssl": True, **{k: v for k, v in options.items() if k in TLS_OPTIONS}} if tls else {},
    )


def sentinel_for(t: SentinelTarget, socket_timeout: float) -> Sentinel:
    auth = {"username": t.sentinel_username, "password": t.sentinel_password}
    return Sentinel(
        t.sentinels,
        sentinel_kwargs={
            **{k: v for k, v in auth.items() if v},
            **t.tls,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
        },
    )


def connect(url: str, **connection_kwargs: Any) -> tuple[redis.Redis, SentinelTarget | None]:
    """A client for `url`'s (current) master, and the Sentinel target when it has one. With
    Sentinel, a connection that finds the master gone or demoted asks the Sentinels again."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **connection_kwargs), None
    t = parse_sentinel(url)
    pool = SentinelConnectionPool(
        t.service,
        sentinel_for(t, connection_kwargs.get("socket_timeout") or 2.0),
        is_master=True,
        db=t.db,
        username=t.username,
        password=t.password,
        **t.tls,
        **connection_kwargs,
    )
    return redis.Redis(connection_pool=pool), t


def replica_clients(t: SentinelTarget, **connection_kwargs: Any) -> list[redis.Redis]:
    """One client per replica the Sentinels know now (same user as the master's client)."""
    sentinel = sentinel_for(t, connection_kwargs.get("socket_timeout") or 2.0)
    return [
        redis.Redis(
            host=host,
            port=port,
            db=t.db,
            username=t.username,
            password=t.password,
            **t.tls,
            **connection_kwargs,
        )
        for host, port in sentinel.discover_slaves(t.service)
    ]


def without_credentials(url: str) -> str:
    """`url` with any user and password dropped, in the netloc and in the options (safe to
    show or hand out)."""
    u = urlsplit(url)
    query = "&".join(o for o in u.query.split("&") if o.partition("=")[0] not in SECRET_OPTIONS)
    return urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, query, u.fragment))


def without_user(url: str) -> str:
    """`url` without its data-node user and password (its hosts and options kept): for a
    client that authenticates through a credential provider."""
    u = urlsplit(url)
    return urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, u.query, u.fragment))


def holds_secret(url: str) -> bool:
    """Whether `url` carries a password, in its netloc or in an option."""
    u = urlsplit(url)
    password = u.netloc.rpartition("@")[0].partition(":")[2]
    return bool(password) or any(o.partition("=")[0] in SECRET_OPTIONS for o in u.query.split("&"))


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` with its data-node user and password replaced (its hosts and options kept)."""
    u = urlsplit(url)
    hosts = u.netloc.rpartition("@")[2] or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{hosts}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))
