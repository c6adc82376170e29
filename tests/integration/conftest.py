"""Integration tests run against the session's shared stack (fixtures in tests/conftest.py,
the stack itself in tests/stack.py). The names below stay importable from here."""

from tests.stack import (  # noqa: F401
    ENV,
    ROOT,
    WORKERS,
    Controller,
    Proc,
    RedisServer,
    Stack,
    process_groups_alive,
    tiny_spec,
    wait_phase,
    wait_until,
)
