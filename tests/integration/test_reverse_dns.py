"""The agent's check of reverse DNS (worker/agent/reverse_dns.py) against a real resolver that
never answers: glibc's own, in a mount namespace whose /etc/resolv.conf names a UDP socket
this test holds open and never replies from, and whose /etc/hosts the test writes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading

import pytest

from tests.launch import ROOT

SILENT_DNS = "127.0.0.77"  # port 53: resolv.conf names no port
CHECK = "from worker.agent.reverse_dns import check; print(check('127.0.0.1'))"


@pytest.fixture
def silent_resolver():
    """A UDP socket on port 53 that reads every query and answers none."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((SILENT_DNS, 53))
    except PermissionError:
        pytest.skip("binding port 53 needs root")
    queries: list[bytes] = []
    sock.settimeout(0.2)
    stop = threading.Event()

    def swallow() -> None:
        while not stop.is_set():
            try:
                queries.append(sock.recvfrom(512)[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=swallow, daemon=True)
    thread.start()
    yield queries
    stop.set()
    thread.join()
    sock.close()


def check_with(tmp_path, hosts: str) -> str:
    """`check` in a mount namespace that sees the silent resolver and `hosts`."""
    resolv, hosts_file = tmp_path / "resolv.conf", tmp_path / "hosts"
    resolv.write_text(f"nameserver {SILENT_DNS}\noptions timeout:1 attempts:1\n")
    hosts_file.write_text(hosts)
    script = (
        f"mount --bind {resolv} /etc/resolv.conf && mount --bind {hosts_file} /etc/hosts && "
        f'exec {sys.executable} -c "{CHECK}"'
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_lookup_the_resolver_never_answers_is_named_with_its_time_and_fix(
    tmp_path, silent_resolver
):
    warning = check_with(tmp_path, "127.0.0.1 localhost\n")
    assert silent_resolver, "the lookup never reached the resolver"
    assert "(::ffff:127.0.0.1) took 1." in warning, warning
    assert "/etc/hosts line '::ffff:127.0.0.1 " in warning, warning


def test_a_lookup_answered_from_etc_hosts_is_not_reported(tmp_path, silent_resolver):
    assert check_with(tmp_path, "127.0.0.1 localhost\n::ffff:127.0.0.1 mapped\n") == "None"
    assert not silent_resolver
