"""The chart's Redis under Sentinel (redis.sentinel.enabled), run for real: each "pod" of the
rendered StatefulSet is its init container's aclfile.sh, then node.sh and sentinel.sh from the
chart's ConfigMap, with the environment the pod spec gives them (secrets and the downward API
filled in). Pods are separate loopback addresses; the chart's DNS names are mapped onto them.

What a user relies on: a fresh install elects the first node; the controller's URLs from the
chart (its own and its provisioner's) reach the master through the Sentinels, and an agent
user made through the provisioner is on every node; a killed master fails over, and the pod that
comes back joins as a replica of the new master (never as a second master); a restart of the
whole set keeps the master it had and every write. Real redis-servers and Sentinels."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import deploytools as dt
import pytest
import redis

from services.procs import free_port, stop_all
from services.store import acl_file
from tests.stack import Proc, wait_until

NAMESPACE = "ml"  # the release namespace deploytools renders with
NODES = 3
ADDRESSES = [f"127.0.0.{31 + i}" for i in range(NODES)]
SECRETS = {
    "redis-admin-password": "admin-pw",
    "redis-controller-password": "controller-pw",
    "redis-provisioner-password": "provisioner-pw",
    "redis-replication-password": "replication-pw",
    "redis-sentinel-password": "discover-pw",
    "redis-sentinel-peer-password": "peer-pw",
    **{k: k + "-value" for k in ("api-token", "scrape-token", "join-token")},
}
VALUES = {
    "redis": {
        "sentinel": {
            "enabled": True,
            "downAfterMilliseconds": 1000,
            "failoverTimeoutMilliseconds": 5000,
        }
    }
}


def objects() -> list[dict]:
    return [d for text in dt.render(VALUES).values() for d in dt.docs(text)]


def one(objs, kind: str, suffix: str) -> dict:
    [found] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return found


def resolve(env: list[dict], pod: str) -> dict[str, str]:
    """A container's environment as the kubelet gives it: values with $(VAR) expanded,
    secretKeyRef from SECRETS, the pod name from the downward API."""
    out: dict[str, str] = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out[m.group(1)], e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            out[e["name"]] = SECRETS[e["valueFrom"]["secretKeyRef"]["key"]]
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            out[e["name"]] = {"metadata.name": pod, "metadata.namespace": NAMESPACE}.get(field, "")
    return out


class ChartSet:
    """The rendered Redis StatefulSet run as local processes, pod by pod."""

    def __init__(self, work: Path):
        self.work, self.objs = work, objects()
        self.sts = one(self.objs, "StatefulSet", "-redis")
        self.scripts = work / "scripts"
        self.scripts.mkdir(parents=True)
        for name, text in one(self.objs, "ConfigMap", "-redis-scripts")["data"].items():
            (self.scripts / name).write_text(text)
        self.redis_port, self.sentinel_port = free_port(), free_port()
        fn = self.sts["metadata"]["name"]
        # the chart's stable names, each mapped onto its own loopback address
        self.hosts = {f"{fn}-{i}.{fn}.{NAMESPACE}.svc": ADDRESSES[i] for i in range(NODES)}
        self.pods: dict[int, list[Proc]] = {}

    def env(self, ordinal: int, container: str) -> dict[str, str]:
        spec = self.sts["spec"]["template"]["spec"]
        c = next(c for c in spec["initContainers"] + spec["containers"] if c["name"] == container)
        env = resolve(c["env"], f"{self.sts['metadata']['name']}-{ordinal}")
        for name, addr in self.hosts.items():
            env = {k: v.replace(name, addr) for k, v in env.items()}
        data = self.work / f"data-{ordinal}"
        data.mkdir(exist_ok=True)
        local = {"PATH": "/usr/bin:/bin", **env, "DATA": str(data)}
        if container == "aclfile":
            return local
        assert env["BIND"] == "* -::*" and env["REDIS_PORT"] == "6379"
        # this machine's own ports and address in place of the pod's
        return {
            **local,
            "REDIS_PORT": str(self.redis_port),
            "SENTINEL_PORT": str(self.sentinel_port),
            "BIND": ADDRESSES[ordinal],
        }

    def start(self, ordinal: int) -> None:
        """One pod: the init container to completion, then its two containers."""
        done = subprocess.run(
            ["sh", str(self.scripts / "aclfile.sh")],
            env=self.env(ordinal, "aclfile"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        self.pods[ordinal] = [
            Proc(
                f"pod{ordinal}-{c}",
                ["sh", str(self.scripts / f"{script}.sh")],
                self.work / "logs",
                env=self.env(ordinal, c),
            )
            for c, script in (("redis", "node"), ("sentinel", "sentinel"))
        ]

    def kill(self, ordinal: int) -> None:
        for p in self.pods.pop(ordinal):
            p.kill(signal.SIGKILL)

    def node(self, ordinal: int) -> redis.Redis:
        return _client(ordinal, self.redis_port, "admin", "redis-admin-password")

    def masters_named(self) -> list[str | None]:
        """The master's address as each running Sentinel names it."""
        named = []
        for ordinal in self.pods:
            with _client(ordinal, self.sentinel_port, "discover", "redis-sentinel-password") as s:
                try:
                    m = s.sentinel_master("mk")
                except redis.RedisError:
                    named.append(None)
                    continue
                whole = m["num-slaves"] == NODES - 1 and m["num-other-sentinels"] == NODES - 1
                named.append(m["ip"] if whole and not m["is_odown"] else None)
        return named

    def agreed_master(self) -> str | None:
        """The master every Sentinel names, each seeing all replicas and peers; else None."""
        named = self.masters_named()
        return named[0] if len(named) == NODES and len(set(named)) == 1 else None

    def controller_url(self) -> str:
        """The controller's REDIS_URL from the chart, on this machine's addresses."""
        return self._controller_env("REDIS_URL")

    def provisioner_url(self) -> str:
        """The controller's REDIS_PROVISIONER_URL (the user that makes agent users) from the
        chart, on this machine's addresses."""
        return self._controller_env("REDIS_PROVISIONER_URL")

    def store(self):
        """A Store as the controller makes one: the reconcile loop's user, and the
        provisioner's for ACL commands (the controller's user may run none)."""
        from services.store import Store

        return Store(self.controller_url(), provisioner_url=self.provisioner_url())

    def _controller_env(self, name: str) -> str:
        ctl = one(self.objs, "Deployment", "-controller")["spec"]["template"]["spec"]
        url = resolve(ctl["containers"][0]["env"], "controller")[name]
        for host, addr in self.hosts.items():
            url = url.replace(f"{host}:26379", f"{addr}:{self.sentinel_port}")
        return url

    def close(self) -> None:
        stop_all([p.p for procs in self.pods.values() for p in procs], 5)


def _client(ordinal: int, port: int, user: str, secret: str) -> redis.Redis:
    return redis.Redis(
        ADDRESSES[ordinal],
        port,
        username=user,
        password=SECRETS[secret],
        decode_responses=True,
        socket_timeout=2,
    )


@pytest.fixture(scope="module")
def chart_set(tmp_path_factory):
    s = ChartSet(tmp_path_factory.mktemp("chart-sentinel"))
    try:
        for ordinal in range(NODES):
            s.start(ordinal)
        yield s
    finally:
        s.close()


def events(r: redis.Redis) -> list[str]:
    return [f["n"] for _, f in r.xrange("mk:job:{j1}:events")]


def test_the_users_file_is_the_store_s(chart_set):
    """aclfile.sh under Sentinel writes what services/store.py acl_file would."""
    users = (chart_set.work / "data-0" / "users.acl").read_text()
    want = acl_file(
        "mk:",
        SECRETS["redis-admin-password"],
        SECRETS["redis-controller-password"],
        SECRETS["redis-provisioner-password"],
        SECRETS["redis-replication-password"],
    )
    assert [line.split()[:2] + line.split()[3:] for line in users.splitlines()] == [
        line.split()[:2] + line.split()[3:] for line in want.splitlines()
    ]  # the same users and rules; the hash of each password checked by logging in below


def test_a_fresh_set_makes_the_first_node_master(chart_set):
    wait_until(chart_set.agreed_master, 60, "every Sentinel to agree on one master")
    assert chart_set.agreed_master() == ADDRESSES[0]
    with chart_set.node(1) as r:
        wait_until(lambda: r.info("replication")["master_link_status"] == "up", 30, "sync")
        assert r.info("replication")["master_host"] == ADDRESSES[0]


def test_the_controller_url_reaches_the_master_through_the_sentinels(chart_set):
    store = chart_set.store()
    for n in range(10):
        store.add_event("j1", {"n": str(n)})  # each waited for a replica (WAIT)
    store.close()
    with chart_set.node(0) as r:
        assert events(r) == [str(n) for n in range(10)]


def test_a_join_makes_the_agent_user_on_every_node_through_the_provisioner(chart_set):
    """The chart's two URLs as the controller uses them: the agent's user is made on the
    master as `provisioner` and copied to every replica (ACL changes do not replicate), while
    the controller's own user may not touch users."""
    store = chart_set.store()
    try:
        assert store.join_worker("w1", {"host": "h1"}, "agent-w1-pw") is True  # ACL SAVE worked
        store.sync_acl()
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.r.execute_command("ACL", "SETUSER", "agent-w9", "on", ">x", "+@all", "~*")
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.r.execute_command("CONFIG", "GET", "dir")
    finally:
        store.close()
    for ordinal in range(NODES):
        with redis.Redis(
            ADDRESSES[ordinal],
            chart_set.redis_port,
            username="agent-w1",
            password="agent-w1-pw",
            socket_timeout=2,
        ) as agent:
            assert agent.ping(), ordinal


def test_a_killed_master_fails_over_and_comes_back_as_a_replica(chart_set):
    chart_set.kill(0)
    wait_until(
        lambda: {m for m in chart_set.masters_named() if m} - {ADDRESSES[0]},
        60,
        "the Sentinels left to promote a replica",
    )
    store = chart_set.store()
    wait_until(lambda: _writes(store, "10"), 60, "a write on the new master")
    store.close()
    chart_set.start(0)
    with chart_set.node(0) as r:
        # a replica from its first answer: never a second master, not even until the
        # Sentinels would have demoted it
        first = wait_until(lambda: r.info("replication"), 30, "pod 0 to answer")
        assert first["role"] == "slave", first
        new = wait_until(chart_set.agreed_master, 60, "every Sentinel, pod 0's too, to agree")
        assert new != ADDRESSES[0]
        assert first["master_host"] == new
        wait_until(lambda: events(r)[:11] == [str(n) for n in range(11)], 30, "pod 0's copy")


def test_a_whole_set_restart_keeps_its_master_and_every_write(chart_set):
    before = chart_set.agreed_master()
    assert before and before != ADDRESSES[0]  # the master is no longer the first node
    for ordinal in range(NODES):
        chart_set.kill(ordinal)
    for ordinal in range(NODES):
        chart_set.start(ordinal)
    assert wait_until(chart_set.agreed_master, 60, "the Sentinels to agree again") == before
    with chart_set.node(ADDRESSES.index(before)) as r:
        assert r.info("replication")["role"] == "master"
        assert events(r)[:11] == [str(n) for n in range(11)]


def _writes(store, n: str) -> bool:
    try:
        store.add_event("j1", {"n": n})
        return True
    except redis.RedisError:
        return False
