"""Session-wide fixtures. The local stack (tests/stack.py) is started once per session, at
the first test that asks for it, and shared by tests/integration and tests/chaos: its 8
agents each import torch, so a second stack would double that cost."""

from __future__ import annotations

import pytest

from tests.stack import RedisServer, Stack


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    """A private redis-server for tests that need no controller or agents."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.proc.alive():
        server.proc.stop(5)


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory) -> Stack:
    s = Stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.close()


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The shared stack, every part up and every worker idle."""
    shared_stack.healthy()
    return shared_stack
