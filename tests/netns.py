"""A private test network of N "hosts", each a Linux network namespace (needs root and `ip`).

    with TestNetwork(2) as net:
        net.gateway                      # "10.213.7.1": the root namespace's side (a bridge)
        net.hosts[0].address             # "10.213.7.2": host 0's own address
        subprocess.run([*net.argv_in(0), "python", "-c", "..."])   # runs inside host 0

Layout, for a subnet 10.213.S.0/24 picked free on this machine:

- in the root namespace: an `unreachable 10.213.0.0/16` route (the whole test range: an
  address of it that no bridge holds is refused here, never sent out the default route) and a
  bridge holding the gateway, 10.213.S.1/24, whose on-link /24 is more specific than that /16;
- per host: a network namespace with loopback up and one veth pair, its root end a port of the
  bridge, its other end `eth0` inside with 10.213.S.(2+i)/24 and a default route via the
  gateway.

Hosts reach each other and the gateway across the bridge, and nothing else: the root namespace
forwards nothing (ip_forward is off here, and nothing in it routes the test range out), so no
packet leaves the machine. A process in the root namespace listening on the gateway address
(the controller, Redis) is reachable from every host.

Names carry a random suffix and the /24 is picked under a lock file, so test sessions running
at the same time on one machine never collide: each adds its own unreachable route (same
prefix, a metric of its own) and removes only that. `close()` (or leaving the `with` block)
kills what still runs in the namespaces and removes every namespace, veth, the bridge and the
route it added, even after a partial setup; it is idempotent.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

RANGE = ipaddress.ip_network("10.213.0.0/16")  # the test range: see `check_range`
LOCK = Path("/run/meshkeeper-test-netns.lock")  # serialises picking a /24 across sessions


class NetnsError(RuntimeError):
    """An `ip` command failed; the message has its argv and stderr."""


def ip(*args: str, check: bool = True) -> str:
    """`ip ARGS`; its stdout. Raises NetnsError with stderr on failure when `check`."""
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p.stdout


def check_range() -> None:
    """Refuse a machine that already uses the test range (an address or a route in it, other
    than another session's test network): this helper must never shadow a real network."""
    for line in ip("-4", "-o", "addr").splitlines() + ip("-4", "route").splitlines():
        for word in line.split():
            try:
                net = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if net.overlaps(RANGE) and not _ours(line):
                raise NetnsError(f"{RANGE} is in use on this machine: {line.strip()}")


def _ours(line: str) -> bool:
    """A line of `ip addr`/`ip route` that belongs to a test network (this or another
    session's): our bridges are named mkbr-*, our guard routes are `unreachable` ones."""
    return "mkbr-" in line or line.startswith("unreachable ")


@dataclass(frozen=True)
class Host:
    """One host of the network: its namespace's name, its address, its root-side veth."""

    index: int
    netns: str
    address: str
    veth: str


class TestNetwork:
    """N hosts as network namespaces on a bridge of their own; see the module's doc."""

    __test__ = False  # a helper, not a test class

    def __init__(self, hosts: int):
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts: {hosts}, want 1 to 250")
        tag = secrets.token_hex(3)  # interface names: at most 15 characters
        self.bridge = f"mkbr-{tag}"
        self.metric = 0  # of this session's own guard route, picked under the lock
        self.hosts: list[Host] = []
        self._route = False
        self._bridge = False
        self._closed = False
        try:
            check_range()
            self.subnet = self._claim_subnet()
            self.gateway = str(self.subnet.network_address + 1)
            for i in range(hosts):
                self._add_host(i, tag)
        except BaseException:
            self.close()
            raise

    # -- setup ------------------------------------------------------------------------------
    def _claim_subnet(self) -> ipaddress.IPv4Network:
        """Under the lock: add the guard route, pick a /24 of RANGE no address on this machine
        is in, and give it to a new bridge (so the next session sees it taken)."""
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = {
                line.split("metric")[1].split()[0]
                for line in ip("route").splitlines()
                if line.startswith(f"unreachable {RANGE} ") and "metric" in line
            }
            self.metric = 1000 + secrets.randbelow(60000)
            while str(self.metric) in taken:
                self.metric = 1000 + secrets.randbelow(60000)
            ip("route", "add", "unreachable", str(RANGE), "metric", str(self.metric))
            self._route = True
            used = {
                ipaddress.ip_interface(w).network
                for line in ip("-4", "-o", "addr").splitlines()
                for w in line.split()
                if "/" in w and _is_interface(w)
            }
            free = [
                s for s in list(RANGE.subnets(new_prefix=24))[1:-1] if s not in used
            ]  # not 10.213.0.0/24 nor .255.0/24: easy to tell apart from a typo'd range
            if not free:
                raise NetnsError(f"no free /24 left in {RANGE}")
            subnet = free[secrets.randbelow(len(free))]
            ip("link", "add", self.bridge, "type", "bridge")
            self._bridge = True
            ip("addr", "add", f"{subnet.network_address + 1}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            return subnet

    def _add_host(self, i: int, tag: str) -> None:
        host = Host(
            i, f"mk-{tag}-host{i}", str(self.subnet.network_address + 2 + i), f"mkv{tag}-{i}"
        )
        ip("netns", "add", host.netns)
        self.hosts.append(host)  # from here on close() removes it
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        ip("link", "set", host.veth, "master", self.bridge, "up")
        ns = ("-n", host.netns)
        ip(*ns, "link", "set", "lo", "up")
        ip(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip(*ns, "link", "set", "eth0", "up")
        ip(*ns, "route", "add", "default", "via", self.gateway)

    # -- use --------------------------------------------------------------------------------
    def argv_in(self, host: int | Host) -> list[str]:
        """The prefix that runs an argv inside `host`'s network namespace (`ip netns exec`
        also gives it a mount namespace of its own, with that namespace's /sys)."""
        h = host if isinstance(host, Host) else self.hosts[host]
        return ["ip", "netns", "exec", h.netns]

    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what still runs in the hosts, then remove every namespace, veth, the bridge
        and this session's guard route. Each step runs even when an earlier one failed; a
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            _kill_all_in(h.netns)
        for h in self.hosts:
            ip("link", "del", h.veth, check=False)  # both ends go
            ip("netns", "del", h.netns, check=False)
        if self._bridge:
            ip("link", "del", self.bridge, check=False)
        if self._route:
            ip("route", "del", "unreachable", str(RANGE), "metric", str(self.metric), check=False)

    def leftovers(self) -> list[str]:
        """What of this network is still on the machine (empty after close())."""
        left = []
        names = ip("netns", "list", check=False)
        left += [f"netns {h.netns}" for h in self.hosts if h.netns in names.split()]
        links = ip("-o", "link", check=False)
        left += [f"link {n}" for n in [self.bridge, *(h.veth for h in self.hosts)] if n in links]
        routes = ip("route", check=False)
        if f"unreachable {RANGE} metric {self.metric}" in routes:
            left.append(f"route unreachable {RANGE} metric {self.metric}")
        return left

    def __enter__(self) -> TestNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_interface(word: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Interface(word)
        return True
    return False


def _kill_all_in(netns: str) -> None:
    """SIGKILL every process in `netns` (`ip netns pids`), until none is left (5 s at most):
    a namespace outlives its deletion while a process holds it."""
    for _ in range(50):
        pids = [int(p) for p in ip("netns", "pids", netns, check=False).split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
