"""Slow clients against a real controller (controller/slow_clients.py): a connection that never
finishes its request headers, one that trickles them a byte at a time, and one that stops
halfway through its body are each closed once the default deadline has passed, while other
clients are served throughout."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

DEADLINE_S = 10.0  # the controller's default --request-timeout
MARGIN_S = 5.0


def closed_after(url: str, first: bytes, trickle: bytes = b"") -> float:
    """Seconds until the server closes a connection that sent `first`, then `trickle` one byte
    a second; inf if it is still open after the deadline and the margin."""
    parts = urlsplit(url)
    t0 = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=1) as s:
        s.sendall(first)
        rest = iter(trickle)
        while time.monotonic() - t0 < DEADLINE_S + MARGIN_S:
            try:
                if s.recv(4096) == b"":
                    return time.monotonic() - t0
            except TimeoutError:
                pass  # still open: a second went by
            except ConnectionResetError:
                return time.monotonic() - t0
            byte = next(rest, None)
            if byte is not None:
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    return time.monotonic() - t0
    return float("inf")


def test_slow_requests_are_cut_off_and_others_are_served(api):
    header = b"GET /healthz HTTP/1.1\r\nHost: controller\r\n"
    clients = {
        "silent after half a header": (header, b""),
        "a byte a second": (
            b"G",
            b"ET /healthz HTTP/1.1\r\nHost: controller\r\nX-Pad: " + b"a" * 60,
        ),
        # with a submitter's token: without one the body is refused (401) before it is read
        "half a body": (
            b"POST /v1/jobs HTTP/1.1\r\nHost: controller\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api.secrets.submitter_token}\r\n".encode()
            + b'Content-Length: 100\r\n\r\n{"name": ',
            b"",
        ),
    }
    closed: dict[str, float] = {}
    threads = [
        threading.Thread(target=lambda k=k, a=a: closed.__setitem__(k, closed_after(api.url, *a)))
        for k, a in clients.items()
    ]
    for t in threads:
        t.start()
    served = []
    while any(t.is_alive() for t in threads):  # the controller answers others meanwhile
        served.append(httpx.get(api.url + "/healthz", timeout=2).status_code)
        time.sleep(1)
    for t in threads:
        t.join()
    assert set(served) == {200} and len(served) >= DEADLINE_S - 1, served
    for name, after in closed.items():
        assert DEADLINE_S - 1 <= after <= DEADLINE_S + MARGIN_S, f"{name}: closed after {after}"
