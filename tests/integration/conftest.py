"""Integration tests run against the session's shared stack (fixtures in tests/conftest.py,
the stack itself in tests/stack.py). The names below stay importable from here."""

import pytest

from services.store import Store
from tests.sentinel_redis import SentinelRedis
from tests.stack import (  # noqa: F401
    ENV,
    ROOT,
    WORKERS,
    Controller,
    Proc,
    RedisServer,
    Stack,
    TestSecrets,
    process_groups_alive,
    tiny_spec,
    wait_phase,
    wait_until,
)


@pytest.fixture
def store(redis_server) -> Store:
    """A Store under prefix `t:` on the test's own redis-server (files using another prefix
    define their own)."""
    s = Store(redis_server.url, prefix="t:")
    yield s
    s.close()


@pytest.fixture(scope="package")
def sentinel(tmp_path_factory) -> SentinelRedis:
    """Redis under Sentinel (a master, a replica, three Sentinels), shared by the suite's
    Sentinel tests: each leaves both nodes up and the master where it was."""
    work = tmp_path_factory.mktemp("sentinel")
    s = SentinelRedis(work / "redis", TestSecrets.create(work / "secrets"))
    s.start()
    try:
        yield s
    finally:
        s.close()
