"""Redis under Sentinel for the tests: a master, one replica and three Sentinels (quorum 2)
on free ports, auth on everywhere, as docs/architecture.md "Redis high availability" deploys
it. Every data node gets the same aclfile (services/store.py `acl_file` with the replication
users); the Sentinels allow anonymous nothing, clients only discovery (`discover`), and one
another everything (`peer`). With `tls` (a certificate for 127.0.0.1 that is its own CA, and
its key) every node and Sentinel serves only TLS, replicates and monitors over it, and the URLs
are rediss+sentinel://."""

from __future__ import annotations

import shutil
from pathlib import Path

import redis

from services.procs import free_port, stop_all
from services.redis_url import with_credentials
from services.store import acl_file
from services.tokens import new_token
from tests.stack import Proc, TestSecrets, wait_until

SERVICE = "mk"
DOWN_AFTER_MS = 1000  # how long the master is silent before the Sentinels fail over

SENTINEL_CONF = """port {port}
bind 127.0.0.1
dir {dir}
sentinel monitor {service} 127.0.0.1 {master} 2
sentinel down-after-milliseconds {service} {down_after}
sentinel failover-timeout {service} 5000
sentinel auth-user {service} sentinel
sentinel auth-pass {service} {replication}
user default off
user discover on >{discover} -@all +ping +auth +hello +client|setname \
+sentinel|get-master-addr-by-name +sentinel|masters +sentinel|master +sentinel|replicas \
+sentinel|slaves +sentinel|sentinels
user peer on >{peer} +@all
sentinel sentinel-user peer
sentinel sentinel-pass {peer}
"""


class SentinelRedis:
    """`url` (admin), `controller_url` and `provisioner_url` are redis+sentinel:// URLs;
    `proc` is the process of the master the Sentinels started with (what a test kills)."""

    def __init__(
        self,
        work: Path,
        secrets: TestSecrets,
        prefix: str = "mk:",
        tls: tuple[Path, Path] | None = None,
    ):
        self.work, self.secrets, self.prefix, self.tls = work, secrets, prefix, tls
        self.replication_password, self.discover_password = new_token(), new_token()
        self.peer_password = new_token()
        self.node_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(3)]
        sentinels = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        scheme, ca = (
            ("rediss+sentinel", f"&ssl_ca_certs={tls[0]}") if tls else ("redis+sentinel", "")
        )
        base = (
            f"{scheme}://{sentinels}/{SERVICE}/0"
            f"?sentinel_username=discover&sentinel_password={self.discover_password}{ca}"
        )
        self.url = with_credentials(base, "admin", secrets.redis_admin_password)
        self.controller_url = with_credentials(
            base, "controller", secrets.redis_controller_password
        )
        self.provisioner_url = with_credentials(
            base, "provisioner", secrets.redis_provisioner_password
        )
        self.nodes: list[Proc] = []
        self.sentinels: list[Proc] = []

    @property
    def proc(self) -> Proc:
        return self.nodes[0]

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        users = acl_file(
            self.prefix,
            self.secrets.redis_admin_password,
            self.secrets.redis_controller_password,
            self.secrets.redis_provisioner_password,
            self.replication_password,
        )
        for i, port in enumerate(self.node_ports):
            d = self.work / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "users.acl").write_text(users)
            argv = [
                exe,
                *self._ports(port),
                *("--bind", "127.0.0.1", "--dir", str(d)),
                *("--save", "", "--appendonly", "yes", "--appendfsync", "always"),
                *("--aclfile", str(d / "users.acl")),
                *("--masteruser", "replica", "--masterauth", self.replication_password),
            ]
            if i:
                argv += ["--replicaof", "127.0.0.1", str(self.node_ports[0])]
            self.nodes.append(Proc(f"redis-node{i}", argv, self.work))
        # the replica in sync before the Sentinels start: their first INFO of the master then
        # lists it (the next comes 10 s later)
        wait_until(self._in_sync, 30, "the replica to finish its first sync")
        for i, port in enumerate(self.sentinel_ports):
            conf = self.work / f"sentinel{i}.conf"
            conf.write_text(
                SENTINEL_CONF.format(
                    port=port,
                    dir=self.work,
                    service=SERVICE,
                    master=self.node_ports[0],
                    down_after=DOWN_AFTER_MS,
                    replication=self.replication_password,
                    discover=self.discover_password,
                    peer=self.peer_password,
                )
            )
            argv = [exe, str(conf), "--sentinel", *self._ports(port)]
            self.sentinels.append(Proc(f"sentinel{i}", argv, self.work))
        wait_until(self._watched, 30, "every Sentinel to see the master, its replica and peers")

    def _ports(self, port: int) -> list[str]:
        """A server's listening options: `port` in the clear, or only TLS there (replicating
        and monitoring over TLS too)."""
        if not self.tls:
            return ["--port", str(port)]
        cert, key = (str(f) for f in self.tls)
        return [
            *("--port", "0", "--tls-port", str(port), "--tls-replication", "yes"),
            *("--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert),
            *("--tls-auth-clients", "no"),
        ]

    def client(self, port: int, **kw) -> redis.Redis:
        """A client of the server at `port`, over TLS when the deployment is."""
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls[0])} if self.tls else {}
        return redis.Redis("127.0.0.1", port, decode_responses=True, socket_timeout=2, **tls, **kw)

    def _in_sync(self) -> bool:
        """The replica's link to the master is up: its first full sync is done (until then a
        failover would promote an empty replica)."""
        with self.client(
            self.node_ports[1], username="admin", password=self.secrets.redis_admin_password
        ) as r:
            try:
                return r.info("replication").get("master_link_status") == "up"
            except redis.RedisError:
                return False

    def _sentinel(self, port: int) -> redis.Redis:
        return self.client(port, username="discover", password=self.discover_password)

    def _watched(self) -> bool:
        for port in self.sentinel_ports:
            with self._sentinel(port) as s:
                try:
                    m = s.sentinel_master(SERVICE)
                except redis.RedisError:
                    return False
                if m["num-slaves"] < 1 or m["num-other-sentinels"] < 2:
                    return False
        return True

    def master_port(self) -> int:
        """The master's port as a majority of Sentinels name it now."""
        named = []
        for port in self.sentinel_ports:
            with self._sentinel(port) as s:
                try:
                    named.append(int(s.sentinel_get_master_addr_by_name(SERVICE)[1]))
                except (redis.RedisError, TypeError):
                    pass
        return max(set(named), key=named.count) if named else 0

    def close(self) -> None:
        stop_all([p.p for p in self.sentinels + self.nodes], 5)
