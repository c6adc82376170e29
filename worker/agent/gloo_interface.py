"""Which network interface a worker's trainers give gloo (`GLOO_SOCKET_IFNAME`).

Unset, torch's gloo binds the address the machine's host name resolves to. On many hosts that
is loopback (Debian's `127.0.1.1` line in /etc/hosts, or `127.0.0.1`), and a peer on another
host is then told to connect to its own loopback: every cross-host gloo group, the CPU side
of `cuda:nccl,cpu:gloo` included, fails to form. The agent knows the address other hosts
reach it at (`--address`), so its trainers bind the interface that holds it."""

from __future__ import annotations

import ipaddress
import socket

import psutil

VARIABLE = "GLOO_SOCKET_IFNAME"


def gloo_env(address: str, environ: dict[str, str]) -> dict[str, str]:
    """{VARIABLE: the interface holding `address`}; nothing where the operator set it already,
    where the address is loopback (one host: any interface works), or where no local
    interface holds it (behind NAT: gloo's own choice is all there is)."""
    if environ.get(VARIABLE):
        return {}
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return {}
    if ipaddress.ip_address(ip).is_loopback:
        return {}
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return {VARIABLE: name}
    return {}
