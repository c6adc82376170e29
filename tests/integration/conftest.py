"""Integration tests run against the session's shared stack (fixtures in tests/conftest.py,
the stack itself in tests/stack.py). The names below stay importable from here."""

import sys
from pathlib import Path

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


def joining_agent(stack: Stack, wid: str, log_dir: Path, *extra: str) -> Proc:
    """An agent of its own that knows only the stack's controller URL and the join token, with
    no warm trainer; `extra`: more of its options."""
    argv = [sys.executable, "-m", "worker", "--controller", stack.controller.url]
    argv += ["--join-token-file", str(stack.secrets.join_token_file), "--id", wid]
    return Proc(f"agent-{wid}", [*argv, "--warm", "0", *extra], log_dir)
