"""Trainers bind gloo to the interface holding their agent's --address
(worker/agent/gloo_interface.py), read from this machine's own interfaces."""

from __future__ import annotations

import socket

import psutil
import pytest

from worker.agent.gloo_interface import VARIABLE, gloo_env


def own_address() -> tuple[str, str]:
    """(interface, IPv4 address) of a non-loopback interface of this machine."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    pytest.skip("this machine has no non-loopback IPv4 address")


def test_the_interface_that_holds_the_address():
    name, address = own_address()
    assert gloo_env(address, {}) == {VARIABLE: name}


def test_the_operators_own_setting_wins():
    _, address = own_address()
    assert gloo_env(address, {VARIABLE: "ib0"}) == {}


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "127.0.1.1", "localhost", "192.0.2.77", "no.such.host.invalid"]
)
def test_loopback_foreign_or_unresolvable_addresses_set_nothing(address):
    assert gloo_env(address, {}) == {}
