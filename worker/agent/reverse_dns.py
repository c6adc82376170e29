"""Whether a reverse DNS lookup of this worker's address is slow enough to stall a rendezvous.

torch's TCPStore server (the job's store, which an agent hosts: worker/agent/job_store.py)
looks up the name of every connection it accepts, one after another on its serving thread, to
format the peer's address (`getnameinfo` without NI_NUMERICHOST). Its socket is dual-stack,
so it sees an IPv4 peer as `::ffff:A`, a form /etc/hosts rarely lists: each lookup goes to
DNS. Where the resolver is slow, or drops a burst of queries and waits out its timeout (5 s
by default), every rank behind that connection waits too, in every generation's rendezvous.
Measured on the build machine: 32 ranks forming a gloo world took 5.1 s with the lookups
going to its resolver and 0.13 s with `::ffff:127.0.0.1` answered from /etc/hosts
(docs/fault-tolerance.md, "How recovery grows").

The agent times one such lookup of its own address at start, off its main loop, and warns
with the fix when it is slow: the store host's resolver answers for every worker's address.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

log = logging.getLogger("meshkeeper.agent")
SLOW_S = 0.5  # far above a resolver's answer (about a millisecond), far below its timeout


def as_store_sees(address: str) -> str | None:
    """The form a dual-stack server sees `address` connect from: `::ffff:A` for an IPv4 A, the
    address itself for IPv6; None for a name that does not resolve."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a name: the IPv4 address it stands for
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0])
        except OSError:
            return None
    return f"::ffff:{ip}" if ip.version == 4 else str(ip)


def lookup_s(peer: str) -> float:
    """Seconds a reverse lookup of `peer` takes (answered or not: a failure is as slow)."""
    start = time.monotonic()
    try:
        socket.getnameinfo((peer, 0, 0, 0), socket.NI_NAMEREQD)
    except OSError:
        pass
    return time.monotonic() - start


def check(address: str) -> str | None:
    """A warning naming the lookup, its time and the fix, or None when it is fast."""
    peer = as_store_sees(address)
    if peer is None:
        return None
    took = lookup_s(peer)
    if took < SLOW_S:
        return None
    return (
        f"a reverse DNS lookup of this worker's address as the rendezvous store sees it "
        f"({peer}) took {took:.1f}s: torch's store looks up every connecting rank's address in "
        f"turn, so each rendezvous waits that long per slow lookup; answer it locally (an "
        f"/etc/hosts line '{peer} {socket.gethostname()}', or a caching resolver such as "
        "nscd) on every host that may run rank 0"
    )


def check_in_background(address: str) -> threading.Thread:
    """`check` on a daemon thread, logged as a warning when slow (a timeout would otherwise
    hold the agent's start for the resolver's whole timeout)."""

    def run() -> None:
        warning = check(address)
        if warning:
            log.warning("%s", warning)

    thread = threading.Thread(target=run, name="reverse-dns-check", daemon=True)
    thread.start()
    return thread
